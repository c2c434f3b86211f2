"""InternLM3: the Llama model (``vllmpy.models.llama``) under its own config converter.

InternLM3 ships as remote code (``modeling_internlm3.py`` beside internlm3-8b-instruct);
its layers are Llama's with two bias switches of their own: ``qkv_bias`` on the q, k and v
projections, ``bias`` on the output projection and on the MLP's three. Its rope is
Llama's rope, usually ``dynamic`` (NTK) scaled, which below max_position_embeddings
rotates as the unscaled rope does. transformers 5 reads the same config as a Llama one
(qkv_bias as attention_bias, bias as mlp_bias) and refuses the two switches apart; the
remote code's reading is taken here.
"""

from __future__ import annotations

from typing import Any

from vllmpy.config import ConfigError
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.llama import LlamaConfig, LlamaForCausalLM

__all__ = ["InternLM3Config", "LlamaForCausalLM"]


def _biases(r: ConfigReader) -> tuple[bool, bool]:
    """(q/k/v bias, output and MLP bias): the remote code's ``qkv_bias`` and ``bias``, or
    the ``attention_bias`` and ``mlp_bias`` a transformers-5 save writes for them."""
    if r.has("qkv_bias") or r.has("bias"):
        return r.get("qkv_bias", False, bool), r.get("bias", False, bool)
    qkv, other = r.get("attention_bias", False, bool), r.get("mlp_bias", False, bool)
    if qkv != other:
        raise ConfigError(f"{r.architecture} config attention_bias={qkv} with mlp_bias="
                          f"{other} is not supported (transformers reads them as qkv_bias "
                          "and bias and refuses them apart); write qkv_bias and bias")
    return qkv, other


class InternLM3Config(LlamaConfig):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> InternLM3Config:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("partial_rotary_factor", unless=1.0, why="InternLM3 rotates whole heads")
        qkv_bias, bias = _biases(r)
        theta, scaling = rope_settings(r)
        return cls(**decoder_fields(r, architecture),
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling, attention_bias=qkv_bias,
                   o_proj_bias=bias, mlp_bias=bias)
