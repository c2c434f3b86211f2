"""IBM Granite MoE (Granite 3.0 MoE, PowerMoE) and GraniteMoeShared: Granite's four
scalars around a sparse MoE MLP in every layer; read top to bottom like the Hugging Face
modeling file, over the flattened tokens of one engine step.

The scalars are Granite's: the embedding is multiplied by ``embedding_multiplier``, each
sublayer's output by ``residual_multiplier`` before its residual add, attention scores by
``attention_multiplier`` (in place of head_dim ** -0.5), and the logits divided by
``logits_scaling``. The MoE block, ``block_sparse_moe``, takes each token's top-k router
logits and softmaxes over those k alone (the same weights as a softmax over every expert
renormalised over the k, but computed as the checkpoint's own model does). GraniteMoeShared
adds a dense gated MLP, ``shared_mlp``, that every token takes beside the experts.

Checkpoints keep the original spelling: ``block_sparse_moe.router.layer`` [E, H],
``block_sparse_moe.input_linear`` [E, 2I, H] (gate rows, then up rows) and
``block_sparse_moe.output_linear`` [E, H, I]; ``shared_mlp.input_linear`` [2S, H] (gate,
then up) and ``shared_mlp.output_linear`` [H, S]. ``load_weights`` renames them into this
model's modules (``CHECKPOINT_NAMES``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import FusedMoE, mark_router, select_experts
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

SHARED_ARCHITECTURE = "GraniteMoeSharedForCausalLM"  # the variant with ``shared_mlp``

# checkpoint name fragment -> this model's module path for it
CHECKPOINT_NAMES = {
    "block_sparse_moe.router.layer.": "block_sparse_moe.router.",
    "block_sparse_moe.input_linear.": "block_sparse_moe.experts.gate_up_proj.",
    "block_sparse_moe.output_linear.": "block_sparse_moe.experts.down_proj.",
    "shared_mlp.input_linear.": "shared_mlp.gate_up_proj.",
    "shared_mlp.output_linear.": "shared_mlp.down_proj.",
}


@dataclass(frozen=True)
class GraniteMoeConfig(TextModelConfig):
    intermediate_size: int  # each expert's
    num_local_experts: int
    num_experts_per_tok: int
    shared_intermediate_size: int  # the shared MLP's (GraniteMoeShared); 0: none
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o carry biases
    embedding_multiplier: float  # the embedding is multiplied by it
    residual_multiplier: float  # each sublayer's output is multiplied by it
    attention_multiplier: float  # the attention scale
    logits_scaling: float  # the logits are divided by it

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GraniteMoeConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")  # the experts' activation
        theta, scaling = rope_settings(r)
        scalars = {key: r.get(key, 1.0, float) for key in (
            "embedding_multiplier", "residual_multiplier", "attention_multiplier",
            "logits_scaling")}
        if scalars["logits_scaling"] == 0:
            raise ConfigError(f"{architecture} config 'logits_scaling'=0 divides the logits "
                              "by zero")
        experts = r.get("num_local_experts", 8, int)
        top_k = r.get("num_experts_per_tok", 2, int)
        if experts < 1 or not 1 <= top_k <= experts:
            raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} must lie "
                              f"in 1..'num_local_experts' ({experts})")
        # GraniteMoe itself has no shared MLP, whatever its config holds
        shared = (r.get("shared_intermediate_size", 0, int)
                  if architecture == SHARED_ARCHITECTURE else 0)
        if shared < 0:
            raise ConfigError(f"{architecture} config 'shared_intermediate_size'={shared} "
                              "must be >= 0 (0: no shared MLP)")
        return cls(**decoder_fields(r, architecture), **scalars,
                   intermediate_size=r.need("intermediate_size"),
                   num_local_experts=experts, num_experts_per_tok=top_k,
                   shared_intermediate_size=shared,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool))


class GraniteMoeMoE(nn.Module):
    """``router`` (Linear [E, H], no bias) picks each token's top-k experts by logit; their
    outputs are weighted by the softmax over those k logits."""

    def __init__(self, config: GraniteMoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = mark_router(Linear(config.hidden_size, config.num_local_experts))
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size,
                                config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, True, "topk_softmax")
        return self.experts(x, weights, ids)


class GraniteMoeDecoderLayer(nn.Module):
    def __init__(self, config: GraniteMoeConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, scale=config.attention_multiplier,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.block_sparse_moe = GraniteMoeMoE(config)
        self.shared_mlp = (GatedMLP(config.hidden_size, config.shared_intermediate_size)
                           if config.shared_intermediate_size > 0 else None)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm adds the previous sublayer's (scaled) output to the residual stream
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        out = self.block_sparse_moe(hidden_states)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(hidden_states)
        return out * self.residual_multiplier, residual


class GraniteMoeModel(nn.Module):
    def __init__(self, config: GraniteMoeConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList(
            [GraniteMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # [num_tokens, hidden_size], times the multiplier as a Python float
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under this model's names (``CHECKPOINT_NAMES``)."""
    for name, tensor in weights:
        for old, new in CHECKPOINT_NAMES.items():
            if old in name:
                name = name.replace(old, new, 1)
                break
        yield name, tensor


class GraniteMoeForCausalLM(nn.Module):
    """GraniteMoe, and GraniteMoeShared when the config has a shared MLP."""

    def __init__(self, config: GraniteMoeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GraniteMoeModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))
        self.logits_scale = (None if config.logits_scaling == 1.0
                             else 1.0 / config.logits_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits divided by ``logits_scaling``."""
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out,
                           scale=self.logits_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names, each layer's experts as two fused
        [E, ...] tensors); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(_renamed(weights)),
                                   PACKED_QKV_GATE_UP, skip) | scales.loaded
