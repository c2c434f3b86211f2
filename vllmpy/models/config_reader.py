"""Reading a Hugging Face ``config.json`` into an architecture's own typed config.

Each architecture's converter (``<Family>Config.from_hf`` beside its model) reads the keys
it implements through a ``ConfigReader``, which names the architecture in every refusal:
a missing required key, a value of the wrong type, and a value the engine does not
implement (``expect``, ``refuse``) are all refused with the key and the value named, so
nothing a checkpoint asks for is silently ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllmpy.config import ConfigError

_MISSING = object()


class ConfigReader:
    """``cfg`` (config.json, or a multimodal config's ``text_config``) of ``architecture``."""

    def __init__(self, cfg: dict[str, Any], architecture: str) -> None:
        self.cfg = cfg
        self.architecture = architecture

    def _where(self, key: str) -> str:
        return f"{self.architecture} config {key!r}"

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def need(self, key: str, kind: type = int) -> Any:
        """The value of a required key, as ``kind``."""
        if self.cfg.get(key) is None:
            raise ConfigError(f"{self._where(key)} is missing; the architecture needs it")
        return self._as(key, self.cfg[key], kind)

    def get(self, key: str, default: Any, kind: type | None = None) -> Any:
        """The value of an optional key (``default`` when absent or null)."""
        value = self.cfg.get(key)
        if value is None:
            return default
        return value if kind is None else self._as(key, value, kind)

    def first(self, keys: Iterable[str], default: Any = _MISSING, kind: type = int) -> Any:
        """The first of ``keys`` that is set (configs of one family spell some keys two ways)."""
        keys = tuple(keys)
        for key in keys:
            if self.cfg.get(key) is not None:
                return self._as(key, self.cfg[key], kind)
        if default is _MISSING:
            raise ConfigError(f"{self.architecture} config has none of "
                              f"{', '.join(map(repr, keys))}; the architecture needs one")
        return default

    def _as(self, key: str, value: Any, kind: type) -> Any:
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{self._where(key)} must be true or false, got {value!r}")
            return value
        if kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and isinstance(value, float) and not value.is_integer()):
                raise ConfigError(f"{self._where(key)} must be a number, got {value!r}")
            return kind(value)
        if not isinstance(value, kind):
            raise ConfigError(f"{self._where(key)} must be a {kind.__name__}, got {value!r}")
        return value

    def expect(self, key: str, allowed: Iterable[Any], default: Any = None) -> Any:
        """The key's value if it is one the engine implements (absent: ``default``, which
        counts as allowed); anything else is refused naming the key, value and choices."""
        allowed = tuple(allowed)
        value = self.cfg.get(key, default)
        if value is None:
            value = default
        if value != default and value not in allowed:
            raise ConfigError(f"{self._where(key)}={value!r} is not supported; supported: "
                              f"{', '.join(map(repr, allowed))}")
        return value

    def refuse(self, key: str, unless: Any = None, why: str = "") -> None:
        """Refuse a key set to anything but ``unless`` (absent and null always pass)."""
        value = self.cfg.get(key)
        if value is not None and value != unless:
            raise ConfigError(f"{self._where(key)}={value!r} is not supported"
                              + (f" ({why})" if why else ""))


def rope_settings(reader: ConfigReader, layer_type: str | None = None
                  ) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, rope scaling or None) of a config, from transformers 5's
    ``rope_parameters`` (optionally keyed by layer type, as Gemma-3's is) or the older
    ``rope_theta`` / ``rope_scaling``; the scaling is checked against what the rotary
    layer implements."""
    from vllmpy.layers.rotary import check_rope_scaling

    params = reader.cfg.get("rope_parameters")
    key = "rope_parameters"
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params, key = params[layer_type], f"rope_parameters.{layer_type}"
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.get("rope_theta", reader.cfg.get("rope_theta", 10000.0))
    scaling = reader.cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        key = "rope_scaling"
    elif params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        scaling = None
    try:
        check_rope_scaling(scaling, key)
    except ValueError as e:
        raise ConfigError(f"{reader.architecture} config: {e}") from None
    return float(theta), scaling


def layer_types(reader: ConfigReader, num_layers: int,
                default: list[str] | None = None) -> list[str]:
    """Per-layer attention kinds (``full_attention`` / ``sliding_attention``) from the
    config's ``layer_types``, else ``default`` (all full)."""
    types = reader.cfg.get("layer_types")
    if types is None:
        return list(default) if default is not None else ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"{reader.architecture} config 'layer_types' must list one kind "
                          f"per layer ({num_layers}), got {types!r}")
    for kind in types:
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{reader.architecture} config 'layer_types' entry {kind!r} is "
                              "not supported; supported: 'full_attention', "
                              "'sliding_attention'")
    return list(types)


def decoder_fields(reader: ConfigReader, architecture: str,
                   layer_windows: tuple[int | None, ...] | None = None,
                   head_dim: int | None = None) -> dict[str, Any]:
    """The ``TextModelConfig`` fields of a decoder config under the common (Llama-style)
    key names: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, max_position_embeddings, vocab_size, tie_word_embeddings."""
    hidden = reader.need("hidden_size")
    heads = reader.need("num_attention_heads")
    layers = reader.need("num_hidden_layers")
    if heads <= 0 or hidden <= 0 or layers <= 0:
        raise ConfigError(f"{architecture} config: hidden_size, num_attention_heads and "
                          f"num_hidden_layers must be positive, got {hidden}, {heads}, {layers}")
    return dict(
        architectures=[architecture],
        model_type=str(reader.get("model_type", "")),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=reader.get("num_key_value_heads", heads, int),
        head_dim=head_dim or reader.get("head_dim", hidden // heads, int),
        max_position_embeddings=reader.get("max_position_embeddings", 2048, int),
        vocab_size=reader.need("vocab_size"),
        tie_word_embeddings=reader.get("tie_word_embeddings", False, bool),
        layer_windows=layer_windows if layer_windows is not None else (None,) * layers,
    )


def windows_of(kinds: list[str], window: int | None) -> tuple[int | None, ...]:
    """Per-layer windows from per-layer kinds: ``window`` on sliding layers."""
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def float_list(reader: ConfigReader, key: str, default: tuple[float, ...],
               length: int | None = None) -> tuple[float, ...]:
    """A list of numbers (``time_step_limit``, ``ssm_multipliers``...), ``default`` when
    absent. transformers writes a non-finite float as ``{"__float__": "Infinity"}``; that
    form reads as the float it names."""
    value = reader.cfg.get(key)
    if value is None:
        return tuple(default)

    def number(v: Any) -> float:
        if isinstance(v, dict) and set(v) == {"__float__"}:
            v = v["__float__"]
            if isinstance(v, str):
                try:
                    return float(v)
                except ValueError:
                    pass
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{reader.architecture} config {key!r} must list numbers, "
                              f"got {value!r}")
        return float(v)

    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{reader.architecture} config {key!r} must be a list of numbers, "
                          f"got {value!r}")
    numbers = tuple(number(v) for v in value)
    if length is not None and len(numbers) != length:
        raise ConfigError(f"{reader.architecture} config {key!r} must list {length} numbers, "
                          f"got {value!r}")
    return numbers
