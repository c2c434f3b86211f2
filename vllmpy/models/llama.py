"""Llama (and Mistral, which has the same layout), read top to bottom like the Hugging
Face modeling file, over the flattened tokens of one engine step."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import TextModelConfig
from vllmpy.layers.attention import Attention, KVScaleLoader
from vllmpy.layers.linear import (
    Linear,
    PackedLinear,
    rms_norm_linear,
    tie_quantized_lm_head,
)
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.weights import load_packed_weights

# checkpoint name fragment -> (packed parameter fragment, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """qkv: qkv_proj's output, [num_tokens, q_size + 2 * kv_size] (the decoder layer
        runs the projection, so that it can take the layer norm into the same launch)."""
        if qkv.is_cuda:  # a decode step: rotary, the KV write and attention at once
            out = self.attn.decode_from_qkv(qkv, positions,
                                            self.rotary_emb.cos_sin_cache(qkv.device),
                                            attn_metadata)
            if out is not None:
                return self.o_proj(out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    # the attention module; a model with Llama's layer around another attention (Qwen3)
    # sets its own
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # each layer norm runs with the projection after it (one launch for one row)
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn(positions, qkv, attn_metadata)
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm,
                                            self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: TextModelConfig) -> None:
        super().__init__()
        # An uninitialised weight: Embedding's own random init would pull in the
        # compiler stack on the meta device (over a second of start-up) for nothing.
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def head_logits(lm_head: Linear | None, embed_tokens: nn.Embedding,
                hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A causal LM's logits: ``lm_head``, or the tied embedding when it is None; into
    ``out`` when given (the same product, with no buffer in between)."""
    if lm_head is not None and lm_head.int4 is not None:
        logits = lm_head(hidden_states)  # a 4-bit head (see layers.linear)
        return logits if out is None else out.copy_(logits)
    weight = embed_tokens.weight if lm_head is None else lm_head.weight
    assert weight is not None  # a head without a 4-bit copy keeps its dense weight
    if out is not None:
        return torch.mm(hidden_states, weight.t(), out=out)
    return torch.nn.functional.linear(hidden_states, weight)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: TextModelConfig) -> None:
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
        return load_packed_weights(self, scales.filter(weights), PACKED_MODULES,
                                   skip) | scales.loaded
