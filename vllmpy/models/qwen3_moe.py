"""Qwen3-MoE: Qwen3's attention (an RMSNorm on each head of q and k) with a sparse MoE
MLP (softmax top-k routing, ``norm_topk_prob`` renormalisation) on every
``decoder_sparse_step``-th layer outside ``mlp_only_layers``, and a dense gated MLP on
the rest; read top to bottom like the Hugging Face modeling file."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import SparseMoeBlock
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
class Qwen3MoeConfig(TextModelConfig):
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: the MoE MLP (else the dense one)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen3MoeConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("partial_rotary_factor", unless=1.0, why="Qwen3-MoE rotates whole heads")
        layers = r.need("num_hidden_layers")
        window = (r.get("sliding_window", None, int)
                  if r.get("use_sliding_window", False, bool) else None)
        first = r.get("max_window_layers", layers, int)
        kinds = layer_types(r, layers, ["sliding_attention" if window and i >= first
                                        else "full_attention" for i in range(layers)])
        theta, scaling = rope_settings(r)
        experts = r.first(("num_experts", "num_local_experts"), 128)  # v5 spells it local
        step = r.get("decoder_sparse_step", 1, int)
        if step < 1:
            raise ConfigError(f"{architecture}: decoder_sparse_step={step} must be >= 1")
        dense = set(r.get("mlp_only_layers", [], list))
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                       for i in range(layers))
        return cls(**decoder_fields(r, architecture, windows_of(kinds, window)),
                   intermediate_size=r.get("intermediate_size", 6144, int),
                   moe_intermediate_size=r.get("moe_intermediate_size", 768, int),
                   num_experts=experts,
                   num_experts_per_tok=r.get("num_experts_per_tok", 8, int),
                   norm_topk_prob=r.get("norm_topk_prob", False, bool),
                   sparse_layers=sparse,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool))


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm=partial(RMSNorm, eps=config.rms_norm_eps),
            sliding_window=config.layer_windows[layer_idx])
        self.mlp: nn.Module
        if config.sparse_layers[layer_idx]:
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                      config.moe_intermediate_size,
                                      config.num_experts_per_tok, config.norm_topk_prob)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3MoeModel(nn.Module):
    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names, one tensor per expert projection);
        returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``qwen3moe``: the expert keys; a layer without a router
    (``ffn_gate_inp``) is a dense one; llama.cpp renormalises the top-k weights of this
    architecture whatever the checkpoint said, so the file runs that way here too."""
    names = meta.tensor_names
    dense = [i for i in range(config["num_hidden_layers"])
             if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {**moe_config(meta, "num_experts"), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": dense}


# llama.cpp's "qwen3moe": Qwen3's q/k norms beside the common MoE names
GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"})
