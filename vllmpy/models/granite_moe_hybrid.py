"""IBM Granite 4.0 hybrid (GraniteMoeHybrid): Granite-MoE decoder layers whose token mixer
is, per ``layer_types``, a Mamba2 mixer (``mamba``) or attention (``self_attn``), followed
by the MoE MLP plus a shared dense MLP (or the shared MLP alone when
``num_local_experts`` is 0); read top to bottom like the Hugging Face modeling file.

Granite's scalars: the embedding times ``embedding_multiplier``, each sublayer's output
times ``residual_multiplier`` before its residual add, attention scores times
``attention_multiplier``, the logits divided by ``logits_scaling``. Attention rotates q
and k only with ``position_embedding_type`` "rope" (the Granite 4.0 checkpoints say
"nope": no positions at all). The router takes each token's top-k logits and softmaxes
over those k.

Checkpoints keep Granite's spelling of the MLPs: ``block_sparse_moe.router.layer``,
``block_sparse_moe.input_linear`` [E, 2I, H] (gate rows, then up rows),
``block_sparse_moe.output_linear`` [E, H, I], ``shared_mlp.input_linear`` [2S, H] and
``shared_mlp.output_linear`` [H, S] (``CHECKPOINT_NAMES`` renames them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.core.cache_spec import CacheSpec, PagedKVSpec
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer, mamba2_state_spec
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import FusedMoE, mark_router, select_experts
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    float_list,
    rope_settings,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

MAMBA, ATTENTION = "linear_attention", "full_attention"
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}

# checkpoint name fragment -> this model's module path for it
CHECKPOINT_NAMES = {
    "block_sparse_moe.router.layer.": "block_sparse_moe.router.",
    "block_sparse_moe.input_linear.": "block_sparse_moe.experts.gate_up_proj.",
    "block_sparse_moe.output_linear.": "block_sparse_moe.experts.down_proj.",
    "shared_mlp.input_linear.": "shared_mlp.gate_up_proj.",
    "shared_mlp.output_linear.": "shared_mlp.down_proj.",
}


def _layer_kinds(r: ConfigReader, layers: int) -> list[str]:
    kinds = r.cfg.get("layer_types", r.cfg.get("layers_block_type"))
    if kinds is None:
        return [MAMBA] * layers  # transformers' default
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"{r.architecture} config 'layer_types' must list one kind per "
                          f"layer ({layers}), got {kinds!r}")
    kinds = [LEGACY_NAMES.get(k, k) for k in kinds]
    for k in kinds:
        if k not in (MAMBA, ATTENTION):
            raise ConfigError(f"{r.architecture} config 'layer_types' entry {k!r} is not "
                              "supported; supported: 'mamba', 'attention' (or "
                              f"{MAMBA!r}, {ATTENTION!r})")
    return kinds


@dataclass(frozen=True)
class GraniteMoeHybridConfig(TextModelConfig):
    layer_kinds: tuple[str, ...]  # per layer: linear_attention (Mamba2) or full_attention
    rms_norm_eps: float
    rope: bool  # position_embedding_type "rope"; else the attention has no positions
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    intermediate_size: int  # each expert's
    num_local_experts: int  # 0: the shared MLP alone
    num_experts_per_tok: int
    shared_intermediate_size: int
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float
    mamba_n_heads: int
    mamba_d_head: int
    mamba_d_state: int
    mamba_n_groups: int
    mamba_d_conv: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GraniteMoeHybridConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")  # the MLPs' and the Mamba layers'
        position = r.expect("position_embedding_type", ("rope", "nope"), None)
        fields = decoder_fields(r, architecture)
        layers, hidden = fields["num_hidden_layers"], fields["hidden_size"]
        kinds = _layer_kinds(r, layers)
        theta, scaling = rope_settings(r)
        scalars = {key: r.get(key, 1.0, float) for key in (
            "embedding_multiplier", "residual_multiplier", "attention_multiplier",
            "logits_scaling")}
        if scalars["logits_scaling"] == 0:
            raise ConfigError(f"{architecture} config 'logits_scaling'=0 divides the logits "
                              "by zero")
        experts = r.get("num_local_experts", 8, int)
        top_k = r.get("num_experts_per_tok", 2, int)
        if experts < 0 or (experts > 0 and not 1 <= top_k <= experts):
            raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} must lie "
                              f"in 1..'num_local_experts' ({experts})")
        heads = r.get("mamba_n_heads", 128, int)
        inner = r.get("mamba_expand", 2, int) * hidden
        head_dim = r.get("mamba_d_head", "auto", None)
        head_dim = inner // heads if head_dim == "auto" else r.get("mamba_d_head", 0, int)
        if head_dim * heads != inner:
            raise ConfigError(f"{architecture} config: mamba_n_heads * mamba_d_head "
                              f"({heads} * {head_dim}) must equal mamba_expand * hidden_size "
                              f"({inner})")
        groups = r.get("mamba_n_groups", 1, int)
        if groups < 1 or heads % groups:
            raise ConfigError(f"{architecture} config 'mamba_n_groups'={groups} must divide "
                              f"mamba_n_heads ({heads})")
        kernel = r.get("mamba_d_conv", 4, int)
        if kernel < 2:
            raise ConfigError(f"{architecture} config 'mamba_d_conv'={kernel} is not "
                              "supported (at least 2)")
        limit = float_list(r, "time_step_limit", (0.0, float("inf")), 2)
        return cls(**fields, **scalars, layer_kinds=tuple(kinds),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float), rope=position == "rope",
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   intermediate_size=r.get("intermediate_size", 11008, int),
                   num_local_experts=experts, num_experts_per_tok=top_k,
                   shared_intermediate_size=r.get("shared_intermediate_size", 1024, int),
                   mamba_n_heads=heads, mamba_d_head=head_dim,
                   mamba_d_state=r.get("mamba_d_state", 256, int), mamba_n_groups=groups,
                   mamba_d_conv=kernel, mamba_conv_bias=r.get("mamba_conv_bias", True, bool),
                   mamba_proj_bias=r.get("mamba_proj_bias", False, bool),
                   time_step_limit=(limit[0], limit[1]))

    def layer_cache_specs(self) -> tuple[CacheSpec, ...]:
        """Per layer its Mamba2 state or its paged K/V, in layer order."""
        mamba = mamba2_state_spec(self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state,
                                  self.mamba_n_groups, self.mamba_d_conv)
        attention = PagedKVSpec(self.num_key_value_heads, self.head_dim, None)
        return tuple(mamba if k == MAMBA else attention for k in self.layer_kinds)


class GraniteMoeHybridMoE(nn.Module):
    """``router`` [E, H] picks each token's top-k experts by logit, weighted by the softmax
    over those k."""

    def __init__(self, config: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = mark_router(Linear(config.hidden_size, config.num_local_experts))
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size,
                                config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, True, "topk_softmax")
        return self.experts(x, weights, ids)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config: GraniteMoeHybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_mamba = config.layer_kinds[layer_idx] == MAMBA
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: SelfAttention | None = None
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                config.hidden_size, config.mamba_n_heads, config.mamba_d_head,
                config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv,
                eps=config.rms_norm_eps, proj_bias=config.mamba_proj_bias,
                conv_bias=config.mamba_conv_bias, time_step_limit=config.time_step_limit)
        else:
            rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
                      if config.rope else None)
            self.self_attn = SelfAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, rotary=rotary, scale=config.attention_multiplier,
                qkv_bias=config.attention_bias, o_bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.block_sparse_moe = (GraniteMoeHybridMoE(config)
                                 if config.num_local_experts > 0 else None)
        self.shared_mlp = GatedMLP(config.hidden_size, config.shared_intermediate_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm adds the previous sublayer's (scaled) output to the residual stream
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.mamba is not None:
            hidden_states = self.mamba(hidden_states, attn_metadata)
        else:
            assert self.self_attn is not None
            hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        out = self.shared_mlp(hidden_states)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden_states) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList([GraniteMoeHybridDecoderLayer(config, i)
                                     for i in range(config.num_hidden_layers)])
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


class GraniteMoeHybridForCausalLM(nn.Module):
    def __init__(self, config: GraniteMoeHybridConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GraniteMoeHybridModel(config)
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
