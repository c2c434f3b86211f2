"""TII Falcon-H1: every decoder layer runs a Mamba2 mixer and attention side by side on
the same normalized input and adds both to the residual stream, then a gated MLP; read
top to bottom like the Hugging Face modeling file.

Its muP multipliers, each a Python float:
- ``embedding_multiplier`` on the embedding, ``lm_head_multiplier`` on the logits;
- ``attention_in_multiplier`` on the attention's input, ``key_multiplier`` on its keys
  (folded into the score scale: q.(m k) = m (q.k)), ``attention_out_multiplier`` on its
  output;
- ``ssm_in_multiplier`` on the mixer's input, ``ssm_multipliers`` on the five parts of its
  input projection (z, x, B, C, dt), ``ssm_out_multiplier`` on its output;
- ``mlp_multipliers``: the gate projection's output (before the activation) and the down
  projection's.

The mixer's gated RMSNorm is optional (``mamba_rms_norm``; without it y * silu(z)) and
normalizes before the gate by default (``mamba_norm_before_gate``). Each layer caches its
Mamba2 state and its paged K/V, in that order (the mixer is registered first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.core.cache_spec import CacheSpec, PagedKVSpec
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.mamba2 import Mamba2Mixer, mamba2_state_spec
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    float_list,
    rope_settings,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "key_multiplier",
               "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
               "ssm_out_multiplier")


@dataclass(frozen=True)
class FalconH1Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    mlp_bias: bool
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool  # the mixer's in_proj bias
    projectors_bias: bool  # the mixer's out_proj bias
    mamba_rms_norm: bool
    mamba_norm_before_gate: bool
    time_step_limit: tuple[float, float]
    embedding_multiplier: float
    lm_head_multiplier: float
    key_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_in_multiplier: float
    ssm_out_multiplier: float
    ssm_multipliers: tuple[float, ...]  # z, x, B, C, dt
    mlp_multipliers: tuple[float, ...]  # gate, down

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> FalconH1Config:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")  # the MLP's and the mixer's
        fields = decoder_fields(r, architecture)
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 8192, int)
        fields["num_key_value_heads"] = r.get("num_key_value_heads", 8, int)
        hidden = fields["hidden_size"]
        theta, scaling = rope_settings(r)
        heads = r.get("mamba_n_heads", 128, int)
        inner = r.get("mamba_d_ssm", None, int) or r.get("mamba_expand", 2, int) * hidden
        head_dim = (inner // heads if r.get("mamba_d_head", "auto") == "auto"
                    else r.get("mamba_d_head", 0, int))
        if head_dim * heads != inner:
            raise ConfigError(f"{architecture} config: mamba_n_heads * mamba_d_head "
                              f"({heads} * {head_dim}) must equal the mixer's width "
                              f"({inner}: mamba_d_ssm, else mamba_expand * hidden_size)")
        groups = r.get("mamba_n_groups", 1, int)
        if groups < 1 or heads % groups:
            raise ConfigError(f"{architecture} config 'mamba_n_groups'={groups} must divide "
                              f"mamba_n_heads ({heads})")
        kernel = r.get("mamba_d_conv", 4, int)
        if kernel < 2:
            raise ConfigError(f"{architecture} config 'mamba_d_conv'={kernel} is not "
                              "supported (at least 2)")
        limit = float_list(r, "time_step_limit", (0.0, float("inf")), 2)
        return cls(**fields, **{key: r.get(key, 1.0, float) for key in MULTIPLIERS},
                   intermediate_size=r.get("intermediate_size", 14336, int),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   mlp_bias=r.get("mlp_bias", False, bool),
                   mamba_n_heads=heads, mamba_d_head=head_dim,
                   mamba_d_state=r.get("mamba_d_state", 256, int), mamba_n_groups=groups,
                   mamba_d_conv=kernel, mamba_conv_bias=r.get("mamba_conv_bias", True, bool),
                   mamba_proj_bias=r.get("mamba_proj_bias", False, bool),
                   projectors_bias=r.get("projectors_bias", False, bool),
                   mamba_rms_norm=r.get("mamba_rms_norm", False, bool),
                   mamba_norm_before_gate=r.get("mamba_norm_before_gate", True, bool),
                   time_step_limit=(limit[0], limit[1]),
                   ssm_multipliers=float_list(r, "ssm_multipliers", (1.0,) * 5, 5),
                   mlp_multipliers=float_list(r, "mlp_multipliers", (1.0, 1.0), 2))

    def layer_cache_specs(self) -> tuple[CacheSpec, ...]:
        """Per layer its Mamba2 state, then its paged K/V."""
        mamba = mamba2_state_spec(self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state,
                                  self.mamba_n_groups, self.mamba_d_conv)
        attention = PagedKVSpec(self.num_key_value_heads, self.head_dim, None)
        return (mamba, attention) * self.num_hidden_layers


class FalconH1MLP(nn.Module):
    """down_proj(up * silu(gate * gate_multiplier)) * down_multiplier, gate and up packed
    (``gate_up_proj``, shard ids 0 and 1)."""

    def __init__(self, config: FalconH1Config) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {0: size, 1: size},
                                         bias=config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: FalconH1Config) -> None:
        super().__init__()
        self.feed_forward = FalconH1MLP(config)
        self.mamba = Mamba2Mixer(
            config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
            config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv,
            eps=config.rms_norm_eps, proj_bias=config.mamba_proj_bias,
            out_bias=config.projectors_bias, conv_bias=config.mamba_conv_bias,
            time_step_limit=config.time_step_limit, rms_norm=config.mamba_rms_norm,
            norm_before_gate=config.mamba_norm_before_gate,
            in_multiplier=config.ssm_in_multiplier,
            proj_multipliers=config.ssm_multipliers)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary,
            scale=config.head_dim ** -0.5 * config.key_multiplier,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention_in_multiplier = config.attention_in_multiplier
        self.attention_out_multiplier = config.attention_out_multiplier
        self.ssm_out_multiplier = config.ssm_out_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        mamba = self.mamba(hidden_states, attn_metadata) * self.ssm_out_multiplier
        attention = self.self_attn(positions, hidden_states * self.attention_in_multiplier,
                                   attn_metadata) * self.attention_out_multiplier
        hidden_states, residual = self.pre_ff_layernorm(mamba + attention, residual)
        return self.feed_forward(hidden_states), residual


class FalconH1Model(nn.Module):
    def __init__(self, config: FalconH1Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList([FalconH1DecoderLayer(config)
                                     for _ in range(config.num_hidden_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # [num_tokens, hidden_size], times the multiplier as a Python float
        hidden_states = self.embed_tokens(input_ids) * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states


class FalconH1ForCausalLM(nn.Module):
    def __init__(self, config: FalconH1Config) -> None:
        super().__init__()
        self.config = config
        self.model = FalconH1Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))
        self.logits_scale = (None if config.lm_head_multiplier == 1.0
                             else config.lm_head_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits times ``lm_head_multiplier``."""
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out,
                           scale=self.logits_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded
