"""Qwen2: the Llama model (``vllmpy.models.llama``) with biases on q, k and v (not on the
output projection) and sliding windows on the layers from ``max_window_layers`` on when
``use_sliding_window`` is set."""

from __future__ import annotations

from typing import Any

from vllmpy.loader.gguf_arch import GGUFArch
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["GGUF_ARCH", "LlamaForCausalLM", "Qwen2Config"]


class Qwen2Config(LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen2Config:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("partial_rotary_factor", unless=1.0, why="Qwen2 rotates whole heads")
        layers = r.need("num_hidden_layers")
        # the window applies only with use_sliding_window, from max_window_layers on
        window = (r.get("sliding_window", None, int)
                  if r.get("use_sliding_window", False, bool) else None)
        first = r.get("max_window_layers", layers, int)
        kinds = layer_types(r, layers, ["sliding_attention" if window and i >= first
                                        else "full_attention" for i in range(layers)])
        theta, scaling = rope_settings(r)
        return cls(**decoder_fields(r, architecture, windows_of(kinds, window)),
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=True, o_proj_bias=False, mlp_bias=False)


GGUF_ARCH = GGUFArch()  # llama.cpp's "qwen2": the common names, rows as in Hugging Face
