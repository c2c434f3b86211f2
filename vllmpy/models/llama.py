"""Llama and Mistral, read top to bottom like the Hugging Face modeling file, over the
flattened tokens of one engine step. Qwen2 (``vllmpy.models.qwen2``) is this model under
its own config converter."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata, moe_config
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class LlamaConfig(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # the q/k/v projections carry biases
    o_proj_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> LlamaConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("partial_rotary_factor", unless=1.0, why="Llama rotates whole heads")
        layers = r.need("num_hidden_layers")
        # Mistral: one window for every layer (null: none)
        window = r.get("sliding_window", None, int)
        kinds = layer_types(r, layers, ["sliding_attention" if window else "full_attention"]
                            * layers)
        theta, scaling = rope_settings(r)
        bias = r.get("attention_bias", False, bool)
        return cls(**decoder_fields(r, architecture, windows_of(kinds, window)),
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling, attention_bias=bias,
                   o_proj_bias=bias,
                   mlp_bias=r.get("mlp_bias", False, bool))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.o_proj_bias,
            sliding_window=config.layer_windows[layer_idx])
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # each layer norm runs with the projection after it (one launch for one row)
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm,
                                            self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """[num_sampled, hidden_size] -> [num_sampled, vocab_size], written into ``out``
        (and returned) when given."""
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """A ``llama`` file with experts is a Mixtral (llama.cpp converts Mixtral as ``llama``
    and renormalises its top-k weights, as Mixtral does)."""
    experts = moe_config(meta, "num_local_experts")
    if not experts.get("num_local_experts"):
        return {}
    return {**experts, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}


# llama.cpp's "llama": the common names, and Mixtral's MoE ones; its converter interleaves
# q/k rows
GGUF_ARCH = GGUFArch(config=_gguf_config, permute_qk=True,
                     block_parts={"ffn_gate_inp": "block_sparse_moe.gate",
                                  "ffn_gate_exps": "block_sparse_moe.experts.w1",
                                  "ffn_up_exps": "block_sparse_moe.experts.w3",
                                  "ffn_down_exps": "block_sparse_moe.experts.w2",
                                  "ffn_gate_up_exps": "block_sparse_moe.experts.gate_up_proj"})
