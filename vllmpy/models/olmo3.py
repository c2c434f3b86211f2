"""OLMo-3: the OLMo-2 model (``vllmpy.models.olmo2``) with sliding-window attention on the
layers ``layer_types`` names (by default every layer but each fourth), and rope settings
per layer kind: a rope scaling (YaRN on the long-context checkpoints) applies to the
global layers only, as transformers reads the config.

From GGUF: llama.cpp writes OLMo-3 as ``olmo2`` (see ``olmo2._gguf_config``).
"""

from __future__ import annotations

from typing import Any

from vllmpy.config import ConfigError
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.olmo2 import LayerRope, Olmo2Config, Olmo2ForCausalLM, gated_act

__all__ = ["Olmo2ForCausalLM", "Olmo3Config"]

KINDS = ("full_attention", "sliding_attention")
DEFAULT_THETA = 500000.0  # transformers' Olmo3Config.default_theta


def _ropes_by_kind(r: ConfigReader) -> dict[str, LayerRope]:
    """(theta, scaling) of the global and the sliding layers. transformers 5 writes
    ``rope_parameters`` keyed by layer kind; an older config's ``rope_theta`` holds for
    both kinds and its ``rope_scaling`` for the global layers only."""
    params = r.cfg.get("rope_parameters")
    if not (isinstance(params, dict) and any(kind in params for kind in KINDS)):
        theta, scaling = rope_settings(r)
        if r.cfg.get("rope_theta") is None and not (isinstance(params, dict)
                                                    and "rope_theta" in params):
            theta = DEFAULT_THETA
        return {"full_attention": (theta, scaling), "sliding_attention": (theta, None)}
    ropes = {}
    for kind in KINDS:
        sub = {"rope_type": "default", "rope_theta": DEFAULT_THETA, **(params.get(kind) or {})}
        if kind == "full_attention" and isinstance(r.cfg.get("rope_scaling"), dict):
            sub.update(r.cfg["rope_scaling"])  # transformers merges it into the global kind
        ropes[kind] = rope_settings(ConfigReader({"rope_parameters": {kind: sub}},
                                                 r.architecture), kind)
    return ropes


class Olmo3Config(Olmo2Config):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Olmo3Config:
        r = ConfigReader(cfg, architecture)
        layers = r.need("num_hidden_layers")
        kinds = layer_types(r, layers, ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                        for i in range(layers)])
        # transformers' default window (4096) when the key is absent; null: none
        window = r.get("sliding_window", None, int) if "sliding_window" in cfg else 4096
        if window is None and "sliding_attention" in kinds:
            raise ConfigError(f"{architecture} config 'sliding_window' is null but "
                              "'layer_types' has sliding_attention layers; give a window")
        ropes = _ropes_by_kind(r)
        return cls(**decoder_fields(r, architecture, windows_of(kinds, window)),
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float), hidden_act=gated_act(r),
                   attention_bias=r.get("attention_bias", False, bool),
                   layer_ropes=tuple(ropes[kind] for kind in kinds))
