"""Rotary position embedding (RoPE) with the scaling types Hugging Face configs name.

A layer's table, ``cos_sin_cache`` [max_position, rotary_dim] float32, holds one row per
position: the cos of its angles in the first half, the sin in the second, with the
scaling's magnitude factor (YaRN's mscale, LongRoPE's attention factor) multiplied into
both. The first ``rotary_dim`` dims of each head rotate and the rest pass through (partial
rotary: StableLM, GPT-NeoX, Phi-4-mini); the pairs that rotate together are the two halves
of those dims (NeoX style: Llama and most checkpoints) or neighbours (GPT-J style: Cohere,
GLM).

Scaling types, by ``rope_type`` (or the legacy ``type``), computed as transformers'
``ROPE_INIT_FUNCTIONS`` compute them:

- ``default``; ``linear``: positions divided by ``factor``; ``llama3``: Llama 3.1's bands.
- ``yarn``: NTK-by-parts between ``beta_fast`` and ``beta_slow`` rotations over
  ``original_max_position_embeddings``; cos/sin times ``attention_factor``, else
  0.1 ln(factor) + 1, or with ``mscale`` and ``mscale_all_dim`` the ratio
  (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1).
- ``dynamic``: one base for every row (vLLM's rule), transformers' NTK base for a sequence
  of max_position tokens on a model trained on ``max_trained_positions`` (default
  max_position): base * (factor * max_position / trained - (factor - 1)) ** (d / (d - 2)),
  d = rotary_dim. With the default that is the unscaled base, transformers' own choice for
  every sequence up to max_position_embeddings (the table's length when max_position is
  that); transformers grows the base only for longer ones.
- ``longrope`` (Phi-3): rows below ``original_max_position_embeddings`` use
  ``short_factor`` (transformers' choice for a sequence within that length), rows from it on
  ``long_factor`` (vLLM's choice once the serving length passes it); both times the
  attention factor (``attention_factor``, else sqrt(1 + ln(factor) / ln(original)) with
  ``factor`` or max_position / original), or vLLM's ``short_mscale`` / ``long_mscale``.
  Unlike vLLM, which then rotates every position with the long factors, a sequence that
  crosses the original length keeps its earlier tokens' short rotation: what transformers'
  token-by-token generation with a KV cache does.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from vllmpy.layers.custom_op import CustomOp
from vllmpy.ops import cpu_kernels
from vllmpy.ops.native import rotary_cpu, rotary_cpu_table, rotary_torch

# rope type -> (fields it needs, optional fields it reads); every type also reads
# rope_theta and partial_rotary_factor when present
SCALING_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ("max_trained_positions",)),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"),
                 ("factor", "attention_factor", "short_mscale", "long_mscale")),
}
_ALIASES = {"su": "longrope"}  # early Phi-3 configs
_INTEGERS = ("original_max_position_embeddings", "max_trained_positions")
_LISTS = ("short_factor", "long_factor")
_ANY_SIGN = ("mscale", "mscale_all_dim")  # numbers; the others must be positive
# fields that ask for something this layer does not do
_REFUSED = {"mrope_section": "multimodal (M-RoPE) positions",
            "alpha": "dynamic NTK-alpha scaling"}


def _scaling_kind(scaling: dict[str, Any]) -> str:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return _ALIASES.get(kind, kind)


def _check_value(where: str, field: str, value: Any) -> None:
    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if field in _LISTS:
        if not (isinstance(value, (list, tuple)) and value
                and all(is_number(v) and v > 0 for v in value)):
            raise ValueError(f"{where}.{field}={value!r} must be a list of positive numbers")
    elif field == "truncate":
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{where}.truncate={value!r} must be true or false")
    elif field in _INTEGERS:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and not (whole and value > 0):
            raise ValueError(f"{where}.{field}={value!r} must be a positive integer")
    elif value is not None and not (is_number(value) and (field in _ANY_SIGN or value > 0)):
        kind = "a number" if field in _ANY_SIGN else "a positive number"
        raise ValueError(f"{where}.{field}={value!r} must be {kind}")


def check_rope_scaling(rope_scaling: dict[str, Any] | None, key: str = "rope_scaling") -> None:
    """Refuse (ValueError, naming ``key`` and the value) a rope-scaling dict that
    ``RotaryEmbedding`` cannot follow: an unknown type, a missing field, a field of the wrong
    kind, or a setting it does not implement. ``None`` passes; so does every dict the
    layer's constructor takes, in transformers 5's ``rope_parameters`` spelling
    (``rope_type``, ``rope_theta`` inside) or the legacy ``rope_scaling`` one (``type``)."""
    if rope_scaling is None:
        return
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"{key}={rope_scaling!r} must be a dict of rope settings")
    given = {f: rope_scaling[f] for f in ("rope_type", "type") if f in rope_scaling}
    for type_key, name in given.items():
        if not isinstance(name, str):
            raise ValueError(f"{key}.{type_key}={name!r} must be the name of a rope type")
    if len({_ALIASES.get(name, name) for name in given.values()}) > 1:
        raise ValueError(f"{key} names two rope types, rope_type={given['rope_type']!r} "
                         f"and type={given['type']!r}; give one")
    kind = _scaling_kind(rope_scaling)
    if kind not in SCALING_FIELDS:
        type_key = next(iter(given), "rope_type")
        raise ValueError(f"{key}.{type_key}={kind!r} is not supported (supported: "
                         f"{', '.join(SCALING_FIELDS)})")
    for field, what in _REFUSED.items():
        if rope_scaling.get(field) is not None:
            raise ValueError(f"{key}.{field}={rope_scaling[field]!r} is not supported "
                             f"({what}); rope type {kind!r} works without it")
    required, optional = SCALING_FIELDS[kind]
    for field in required:
        if rope_scaling.get(field) is None:
            raise ValueError(f"{key} of rope type {kind!r} needs {field!r} (it has: "
                             f"{', '.join(sorted(rope_scaling))})")
    for field in (*required, *optional, "rope_theta", "partial_rotary_factor"):
        if field in rope_scaling:
            _check_value(key, field, rope_scaling[field])
    prf = rope_scaling.get("partial_rotary_factor")
    if prf is not None and prf > 1:
        raise ValueError(f"{key}.partial_rotary_factor={prf!r} must be at most 1")
    if kind == "llama3" and rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]:
        raise ValueError(f"{key}.high_freq_factor={rope_scaling['high_freq_factor']!r} must "
                         f"exceed low_freq_factor={rope_scaling['low_freq_factor']!r}")


# ---- inverse frequencies, one function per type: (inv_freq [dim / 2], cos/sin factor) ----

def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _linear(dim: int, base: float, s: dict[str, Any], _: int) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(dim, base) / s["factor"], 1.0


def _llama3(dim: int, base: float, s: dict[str, Any], _: int) -> tuple[torch.Tensor, float]:
    inv_freq = _default_inv_freq(dim, base)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled), 1.0


def _dynamic(dim: int, base: float, s: dict[str, Any],
             max_position: int) -> tuple[torch.Tensor, float]:
    factor, trained = s["factor"], s.get("max_trained_positions") or max_position
    base = base * ((factor * max_position / trained) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(dim, base), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict[str, Any], _: int) -> tuple[torch.Tensor, float]:
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention, mscale, mscale_all = (s.get(f) for f in ("attention_factor", "mscale",
                                                        "mscale_all_dim"))
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp  # the share of each frequency left unscaled
    inv_freq = (1.0 / (factor * pos_freqs) * (1 - extrapolated)
                + 1.0 / pos_freqs * extrapolated)
    return inv_freq, float(attention)


_INV_FREQ = {"linear": _linear, "llama3": _llama3, "dynamic": _dynamic, "yarn": _yarn}


def _rows(start: int, stop: int, inv_freq: torch.Tensor, mscale: float) -> torch.Tensor:
    """cos/sin rows of positions [start, stop): [stop - start, 2 * len(inv_freq)]."""
    t = torch.arange(start, stop, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [positions, rotary_dim / 2]
    return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)


def _longrope_table(dim: int, base: float, s: dict[str, Any],
                    max_position: int) -> torch.Tensor:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_position / old_len
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(ext_factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base ** shape)

    short_mscale, long_mscale = (s.get(f) for f in ("short_mscale", "long_mscale"))
    parts = [_rows(0, min(old_len, max_position), inv_freq(s["short_factor"]),
                   attention if short_mscale is None else short_mscale)]
    if max_position > old_len:
        parts.append(_rows(old_len, max_position, inv_freq(s["long_factor"]),
                           attention if long_mscale is None else long_mscale))
    return torch.cat(parts)


class RotaryEmbedding(CustomOp):
    """Applies rotary embeddings to q and k, [num_tokens, num_heads * head_dim] or
    [num_tokens, num_heads, head_dim] (the same shapes come back).

    ``rope_scaling`` is a dict ``check_rope_scaling`` passes (or None); ``rotary_dim``
    (default: head_dim times the dict's ``partial_rotary_factor``, else head_dim) dims of
    each head rotate; ``is_neox_style=False`` pairs neighbours (GPT-J, Cohere). The table is
    built on first use on the device of the inputs, in float32, once for all layers with the
    same settings (as is the CPU's own ``rotary_cpu_table``). ``fusable``: the fused CUDA
    kernels, which rotate whole heads in halves, may rotate with ``cos_sin_cache``.
    """

    _cpu: Any = None  # the C kernels, once bound to a CPU that has them

    SUPPORTED_SCALING = tuple(SCALING_FIELDS)
    _tables: ClassVar[dict[tuple[Any, ...], torch.Tensor]] = {}
    _cpu_tables: ClassVar[dict[tuple[Any, ...], torch.Tensor]] = {}

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, *, rotary_dim: int | None = None,
                 is_neox_style: bool = True) -> None:
        super().__init__()
        check_rope_scaling(rope_scaling)
        scaling = dict(rope_scaling or {})
        kind = _scaling_kind(scaling)
        rotary_dim = self._rotary_dim(head_dim, rotary_dim, scaling)
        if scaling.get("rope_theta") is not None and float(scaling["rope_theta"]) != base:
            raise ValueError(f"rope_scaling.rope_theta={scaling['rope_theta']!r} differs from "
                             f"base={base!r}")
        for field in _LISTS if kind == "longrope" else ():
            if len(scaling[field]) != rotary_dim // 2:
                raise ValueError(f"rope_scaling.{field} has {len(scaling[field])} values; "
                                 f"rotary_dim {rotary_dim} needs {rotary_dim // 2}")
        if max_position <= 0:
            raise ValueError(f"max_position must be positive, got {max_position}")
        self.head_dim, self.rotary_dim, self.is_neox_style = head_dim, rotary_dim, is_neox_style
        self.max_position, self.base = max_position, base
        self.rope_scaling, self.scaling_kind = rope_scaling, kind
        self._scaling = scaling  # the constructor's own copy, read when the table is built
        settings = tuple(sorted((f, repr(v)) for f, v in scaling.items()
                                if f not in ("rope_type", "type")))
        # what the shared tables are keyed by, with the device
        self._table_key = (head_dim, rotary_dim, is_neox_style, max_position, float(base),
                           kind, settings)
        # whether the fused kernels may rotate with cos_sin_cache (whole heads, in halves)
        self.fusable = is_neox_style and rotary_dim == head_dim

    @staticmethod
    def _rotary_dim(head_dim: int, rotary_dim: int | None, scaling: dict[str, Any]) -> int:
        prf = scaling.get("partial_rotary_factor")
        from_factor = None if prf is None else int(head_dim * prf)
        if rotary_dim is None:
            rotary_dim = head_dim if from_factor is None else from_factor
        elif from_factor is not None and from_factor != rotary_dim:
            raise ValueError(f"rotary_dim={rotary_dim} disagrees with rope_scaling."
                             f"partial_rotary_factor={prf!r} (head_dim {head_dim} x {prf} = "
                             f"{from_factor})")
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got "
                             f"{rotary_dim}")
        return rotary_dim

    def _cos_sin(self) -> torch.Tensor:
        """[max_position, rotary_dim] float32 on the CPU."""
        scaling = self._scaling
        if self.scaling_kind == "longrope":
            return _longrope_table(self.rotary_dim, self.base, scaling, self.max_position)
        if self.scaling_kind == "default":
            inv_freq, mscale = _default_inv_freq(self.rotary_dim, self.base), 1.0
        else:
            inv_freq, mscale = _INV_FREQ[self.scaling_kind](self.rotary_dim, self.base,
                                                            scaling, self.max_position)
        return _rows(0, self.max_position, inv_freq, mscale)

    def _settings(self, device: torch.device) -> tuple[Any, ...]:
        return (*self._table_key, device)

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_position, rotary_dim] float32: cos in the first half, sin in the second,
        the scaling's magnitude factor multiplied in."""
        key = self._settings(device)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._cos_sin().to(device)
        return table

    def cpu_table(self, device: torch.device) -> torch.Tensor:
        """``rotary_cpu_table`` of this layer's cos/sin, built once per settings and device."""
        key = self._settings(device)
        table = self._cpu_tables.get(key)
        if table is None:
            table = self._cpu_tables[key] = rotary_cpu_table(self._cos_sin()).to(device)
        return table

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_neox_style and self._cpu is not None:
            rotated = self._rotate_in_c(positions, q, k)
            if rotated is not None:
                return rotated
        if self.is_neox_style:
            return rotary_cpu(positions, q, k, self.cpu_table(q.device), self.head_dim)
        return rotary_torch(positions, q, k, self.cos_sin_cache(q.device), self.head_dim,
                            is_neox_style=False)

    def _rotate_in_c(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``rotary_cpu``'s result through the C kernel, on fresh copies of q and k; None
        for shapes it does not take."""
        n = q.shape[0]
        q2, k2 = q.reshape(n, -1), k.reshape(n, -1)
        cache = self.cos_sin_cache(q.device)
        if (not cpu_kernels.takes_rows(q2, k2) or cache.shape[1] > 1024
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            return None
        q2, k2 = q2.clone(memory_format=torch.contiguous_format), \
            k2.clone(memory_format=torch.contiguous_format)
        cpu_kernels.rotary_neox(self._cpu, positions, q2, k2, cache, self.head_dim,
                                cpu_kernels.threads_for(q2.numel() + k2.numel()))
        return q2.view(q.shape), k2.view(k.shape)

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        self._cpu = cpu_kernels.kernels() if device.type == "cpu" else None
        if self.on_cuda and self.fusable:
            from vllmpy.ops import fused

            self._fused = fused

    def forward_cuda(self, positions: torch.Tensor, q: torch.Tensor,
                     k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.fusable:  # partial or interleaved: the kernel rotates whole heads
            return self.forward_native(positions, q, k)
        cache = self.cos_sin_cache(q.device)
        # [num_tokens, num_heads * head_dim] (a view when q, k already are)
        q2, k2 = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)
        q2, k2 = self._fused.rotary_embedding(positions, q2, k2, cache, self.head_dim)
        return q2.view(q.shape), k2.view(k.shape)
