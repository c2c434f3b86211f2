"""Phi-3, Phi-3.5 and Phi-4-mini, read top to bottom like the Hugging Face modeling file,
over the flattened tokens of one engine step.

Against Llama: the checkpoint stores q, k and v as one ``qkv_proj`` and gate and up as one
``gate_up_proj`` (each loads straight into the packed parameter); long-context checkpoints
rotate with LongRoPE (``short_factor`` / ``long_factor`` over
``original_max_position_embeddings``); Phi-4-mini rotates only the first
``partial_rotary_factor`` of each head; a ``sliding_window`` applies to every layer.

From GGUF (llama.cpp's ``phi3``): the fused tensors keep their names (``attn_qkv``, and
``ffn_up`` holding gate and up); the LongRoPE factors are the tensors
``rope_factors_long`` / ``rope_factors_short`` and the attention factor the metadata key
``phi3.rope.scaling.attn_factor``, read back into ``rope_scaling``; a sliding window of 0
means none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import UnsupportedActivationError, check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


def _longrope_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with its rope dict completed as transformers' Phi3Config completes it: the
    legacy types ``su`` and ``yarn`` read as ``longrope``, and the top-level
    ``original_max_position_embeddings`` (default 4096) inside a LongRoPE dict that lacks
    it."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        rope = dict(rope)
        kind = rope.get("rope_type", rope.get("type"))
        if kind in ("su", "yarn"):
            rope.pop("type", None)
            rope["rope_type"] = kind = "longrope"
        if kind == "longrope":
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings") or 4096)
        return {**cfg, key: rope}
    return cfg


@dataclass(frozen=True)
class Phi3Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # the gate's activation
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or LongRoPE
    rotary_dim: int  # dims of each head that rotate (Phi-4-mini: 3/4 of them)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Phi3Config:
        cfg = _longrope_config(cfg)
        r = ConfigReader(cfg, architecture)
        try:
            act = check_activation(r.get("hidden_act", "silu", str), "hidden_act", gated=True)
        except UnsupportedActivationError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        theta, scaling = rope_settings(r)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", "longrope"):
            raise ConfigError(f"{architecture} config: rope type {kind!r} is not supported "
                              "(Phi-3 rotates with the default rope or LongRoPE)")
        fields = decoder_fields(r, architecture)
        if not r.has("max_position_embeddings"):
            fields["max_position_embeddings"] = 4096  # transformers' Phi3Config default
        # transformers 5 keeps the factor in rope_parameters, older configs at the top
        params = cfg.get("rope_parameters")
        factor = float(params["partial_rotary_factor"]) if isinstance(params, dict) and \
            params.get("partial_rotary_factor") is not None else \
            r.get("partial_rotary_factor", 1.0, float)
        if scaling is not None:
            scaling = {**scaling, "partial_rotary_factor": factor}
        window = r.get("sliding_window", None, int)
        return cls(**{**fields, "layer_windows": (window,) * fields["num_hidden_layers"]},
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float), hidden_act=act,
                   rope_theta=theta, rope_scaling=scaling,
                   rotary_dim=int(fields["head_dim"] * factor))


class Phi3DecoderLayer(nn.Module):
    def __init__(self, config: Phi3Config, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling,
                                 rotary_dim=config.rotary_dim)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, sliding_window=config.layer_windows[layer_idx])
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm,
                                            self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up), residual


class Phi3Model(nn.Module):
    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Phi3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Phi3ForCausalLM(nn.Module):
    def __init__(self, config: Phi3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Phi3Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded.
        The fused ``qkv_proj`` and ``gate_up_proj`` fill their packed parameters whole."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF: llama.cpp's "phi3" --------------------------------------------------------

_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Phi-3 converter writes beside the common keys: a sliding window of
    0 for none, the original context length, and the LongRoPE factors as two tensors."""
    arch = meta.architecture
    window = meta.metadata(f"{arch}.attention.sliding_window")
    extra: dict[str, Any] = {"sliding_window": int(window) if window else None}
    original = meta.metadata(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        extra["original_max_position_embeddings"] = int(original)
    present = [name for name in _ROPE_FACTORS if name in meta.tensor_names]
    if not present:
        return extra
    if len(present) != len(_ROPE_FACTORS) or original is None:
        raise ConfigError(f"{meta.path}: LongRoPE needs both {' and '.join(_ROPE_FACTORS)} "
                          f"and {arch}.rope.scaling.original_context_length; the file has "
                          f"{present} and original length {original!r}")
    tensors = {t.name: t for t in open_gguf_file(meta.path).tensors if t.name in _ROPE_FACTORS}

    def factors(name: str) -> list[float]:
        t = tensors[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]

    scaling: dict[str, Any] = {"rope_type": "longrope",
                               "long_factor": factors("rope_factors_long.weight"),
                               "short_factor": factors("rope_factors_short.weight"),
                               "original_max_position_embeddings": int(original)}
    attn_factor = meta.metadata(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(np.float32(attn_factor))
    return {**extra, "rope_scaling": scaling}


GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     skip=frozenset(_ROPE_FACTORS))
