"""IBM Granite (3.x), read top to bottom like the Hugging Face modeling file, over the
flattened tokens of one engine step.

Against Llama, four scalars: the embedding is multiplied by ``embedding_multiplier``, each
sublayer's output by ``residual_multiplier`` before its residual add, attention scores by
``attention_multiplier`` (in place of head_dim ** -0.5), and the logits divided by
``logits_scaling``. Biases on q, k, v and o follow ``attention_bias``, on the MLP
``mlp_bias``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class GraniteConfig(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # the MLP gate's activation
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o carry biases
    mlp_bias: bool
    embedding_multiplier: float  # the embedding is multiplied by it
    residual_multiplier: float  # each sublayer's output is multiplied by it
    attention_multiplier: float  # the attention scale
    logits_scaling: float  # the logits are divided by it

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GraniteConfig:
        r = ConfigReader(cfg, architecture)
        try:
            act = check_activation(r.get("hidden_act", "silu", str), "hidden_act", gated=True)
        except UnsupportedActivationError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        theta, scaling = rope_settings(r)
        scalars = {key: r.get(key, 1.0, float) for key in (
            "embedding_multiplier", "residual_multiplier", "attention_multiplier",
            "logits_scaling")}
        if scalars["logits_scaling"] == 0:
            raise ConfigError(f"{architecture} config 'logits_scaling'=0 divides the logits "
                              "by zero")
        return cls(**decoder_fields(r, architecture), **scalars,
                   intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float), hidden_act=act,
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   mlp_bias=r.get("mlp_bias", False, bool))


class GraniteDecoderLayer(nn.Module):
    def __init__(self, config: GraniteConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, scale=config.attention_multiplier,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act,
                            bias=config.mlp_bias)
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
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm,
                                            self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up) * self.residual_multiplier, residual


class GraniteModel(nn.Module):
    def __init__(self, config: GraniteConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList(
            [GraniteDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # times the multiplier as a Python float, as transformers does
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GraniteForCausalLM(nn.Module):
    def __init__(self, config: GraniteConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GraniteModel(config)
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
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded
