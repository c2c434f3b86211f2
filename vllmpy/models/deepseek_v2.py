"""DeepSeek-V2, V2-Lite and V3: multi-head latent attention (``vllmpy.layers.mla``) on every
layer, dense gated MLPs on the first ``first_k_dense_replace`` layers and MoE MLPs after
them (routed experts plus ``n_shared_experts`` experts' worth of shared MLP that every token
takes); read top to bottom like transformers' deepseek_v2 / deepseek_v3 modeling files.

Routing, as transformers 5.24 defines it:
- DeepSeek-V2 (``topk_method`` ``greedy`` or ``group_limited_greedy``): softmax over the
  experts, the top k (within the best ``topk_group`` of ``n_group`` groups, ranked by their
  best expert, for the group-limited method), times ``routed_scaling_factor``; never
  renormalised;
- DeepSeek-V3 (``noaux_tc``): sigmoid scores plus ``e_score_correction_bias`` pick the
  best ``topk_group`` groups (by the sum of their two best) and the top k inside them;
  their unbiased scores, renormalised when ``norm_topk_prob``, times the scaling factor.
The router's weight stays float32 and its logits are computed in float32, as transformers
keeps them.

The engine's view of the cache: one ``MLASpec`` per layer (``layer_cache_specs``). The
``TextModelConfig`` KV fields say the same in the old terms: ``num_key_value_heads`` = 1
(one latent shared by every head) and ``head_dim`` = kv_lora_rank + qk_rope_head_dim (its
width); a size computed from them as K and V heads counts the latent twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.core.cache_spec import MLASpec
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.mla import MultiHeadLatentAttention, mla_softmax_scale
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import FusedMoE, select_experts
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import load_packed_weights

# checkpoint gate/up projections -> the packed gate_up_proj of dense and shared MLPs
PACKED_GATE_UP: dict[str, tuple[str, str | int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class DeepseekV2Config(TextModelConfig):
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each routed expert's (and each shared expert's)
    n_routed_experts: int
    n_shared_experts: int  # the shared MLP is this many experts wide (0: none)
    num_experts_per_tok: int
    sparse_layers: tuple[bool, ...]  # per layer: the MoE MLP (else the dense one)
    scoring: str  # "softmax" (V2) or "sigmoid" (V3), as select_experts names them
    n_group: int | None  # expert groups of group-limited routing (None: no groups)
    topk_group: int | None  # groups a token's experts come from
    norm_topk_prob: bool  # V3: renormalise the chosen experts' scores
    routed_scaling_factor: float
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_interleave: bool  # the rope dims rotate in neighbouring pairs (else halves)
    attention_bias: bool  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    mlp_bias: bool  # biases on the dense and shared MLPs (V2's mlp_bias)
    num_nextn_predict_layers: int  # V3's MTP layers in the checkpoint (not loaded here)

    def layer_cache_specs(self) -> tuple[Any, ...]:
        return tuple(MLASpec(self.kv_lora_rank, self.qk_rope_head_dim)
                     for _ in range(self.num_hidden_layers))

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> DeepseekV2Config:
        r = ConfigReader(cfg, architecture)
        r.expect("scoring_func", ("softmax",), "softmax")
        method = r.expect("topk_method", ("greedy", "group_limited_greedy"), "greedy")
        r.refuse("norm_topk_prob", unless=False,
                 why="transformers' DeepSeek-V2 never renormalises the top-k weights, "
                     "DeepSeek's own code does; no released V2 checkpoint sets it")
        grouped = method == "group_limited_greedy"
        return cls(**_fields(r, architecture, grouped=grouped, defaults=_V2_DEFAULTS),
                   scoring="softmax", norm_topk_prob=False, rope_interleave=True,
                   mlp_bias=r.get("mlp_bias", False, bool), num_nextn_predict_layers=0)


@dataclass(frozen=True)
class DeepseekV3Config(DeepseekV2Config):
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> DeepseekV3Config:
        r = ConfigReader(cfg, architecture)
        r.expect("scoring_func", ("sigmoid",), "sigmoid")
        r.expect("topk_method", ("noaux_tc",), "noaux_tc")
        r.refuse("mlp_bias", unless=False, why="DeepSeek-V3's MLPs have no biases")
        mtp = r.first(("num_nextn_predict_layers", "num_mtp_layers"), 1)
        return cls(**_fields(r, architecture, grouped=True, defaults=_V3_DEFAULTS),
                   scoring="sigmoid", norm_topk_prob=r.get("norm_topk_prob", True, bool),
                   rope_interleave=r.get("rope_interleave", True, bool), mlp_bias=False,
                   num_nextn_predict_layers=mtp)


# transformers' defaults of the keys whose defaults differ between the two configs
_V2_DEFAULTS = dict(n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0,
                    routed_scaling_factor=1.0, n_group=None, topk_group=None,
                    num_experts_per_tok=None, intermediate_size=11008,
                    moe_intermediate_size=1407, max_position_embeddings=2048)
_V3_DEFAULTS = dict(n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3,
                    routed_scaling_factor=2.5, n_group=8, topk_group=4,
                    num_experts_per_tok=8, intermediate_size=18432,
                    moe_intermediate_size=2048, max_position_embeddings=4096)


def _fields(r: ConfigReader, architecture: str, grouped: bool,
            defaults: dict[str, Any]) -> dict[str, Any]:
    """The fields both configs read alike (``defaults``: the family's own)."""
    r.expect("hidden_act", ("silu",), "silu")
    r.refuse("moe_layer_freq", unless=1,
             why="transformers' DeepSeek modeling ignores it and DeepSeek's own code puts a "
                 "MoE MLP on every moe_layer_freq-th layer; released checkpoints use 1")
    fields = decoder_fields(r, architecture)
    heads, layers = fields["num_attention_heads"], fields["num_hidden_layers"]
    if fields["num_key_value_heads"] != heads:
        raise ConfigError(f"{architecture} config 'num_key_value_heads'="
                          f"{fields['num_key_value_heads']} is not supported: multi-head "
                          f"latent attention expands its latent into all {heads} heads "
                          "(num_key_value_heads = num_attention_heads)")
    if r.cfg.get("max_position_embeddings") is None:
        fields["max_position_embeddings"] = defaults["max_position_embeddings"]
    experts = r.first(("n_routed_experts", "num_experts", "num_local_experts"),
                      defaults["n_routed_experts"])
    top_k = r.get("num_experts_per_tok", defaults["num_experts_per_tok"], int)
    first_dense = r.get("first_k_dense_replace", defaults["first_k_dense_replace"], int)
    sparse = tuple(experts > 0 and i >= first_dense for i in range(layers))
    n_group = topk_group = None
    if any(sparse):
        if top_k is None or not 1 <= top_k <= experts:
            raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k!r} must "
                              f"lie in 1..n_routed_experts ({experts})")
        if grouped:
            n_group, topk_group = _groups(r, architecture, experts, top_k, defaults)
    kv_lora_rank = r.get("kv_lora_rank", 512, int)
    rope_dim = r.get("qk_rope_head_dim", 64, int)
    q_lora_rank = r.cfg.get("q_lora_rank", 1536)  # an explicit null: no query compression
    if q_lora_rank is not None:
        q_lora_rank = r.get("q_lora_rank", 1536, int)
    theta, scaling = rope_settings(r)
    # the engine's old KV fields: one latent of kv_lora_rank + rope dims per token
    fields.update(num_key_value_heads=1, head_dim=kv_lora_rank + rope_dim)
    return dict(
        **fields,
        intermediate_size=r.get("intermediate_size", defaults["intermediate_size"], int),
        moe_intermediate_size=r.get("moe_intermediate_size",
                                    defaults["moe_intermediate_size"], int),
        n_routed_experts=experts,
        n_shared_experts=r.get("n_shared_experts", defaults["n_shared_experts"], int),
        num_experts_per_tok=top_k or 1, sparse_layers=sparse,
        n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=r.get("routed_scaling_factor",
                                    defaults["routed_scaling_factor"], float),
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=r.get("qk_nope_head_dim", 128, int), qk_rope_head_dim=rope_dim,
        v_head_dim=r.get("v_head_dim", 128, int),
        rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
        rope_theta=theta, rope_scaling=scaling,
        attention_bias=r.get("attention_bias", False, bool))


def _groups(r: ConfigReader, architecture: str, experts: int, top_k: int,
            defaults: dict[str, Any]) -> tuple[int, int]:
    n_group = r.get("n_group", defaults["n_group"], int)
    topk_group = r.get("topk_group", defaults["topk_group"], int)
    if n_group is None or topk_group is None:
        raise ConfigError(f"{architecture} config: group-limited routing needs 'n_group' "
                          f"and 'topk_group' (got {n_group!r}, {topk_group!r})")
    if n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(f"{architecture} config 'n_group'={n_group} must divide "
                          f"n_routed_experts ({experts}) and 'topk_group'={topk_group} lie "
                          f"in 1..n_group")
    if topk_group * (experts // n_group) < top_k:
        raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} is more "
                          f"than the {topk_group} groups of {experts // n_group} experts a "
                          "token may route to")
    return n_group, topk_group


class DeepseekV2TopkRouter(nn.Module):
    """The router: ``weight`` [E, H] (float32) and, for V3's routing,
    ``e_score_correction_bias`` [E] (float32); forward gives float32 logits."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.weight.keep_dtype = True  # type: ignore[attr-defined]
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.keep_dtype = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)  # [num_tokens, num_experts]


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.config = config
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = DeepseekV2TopkRouter(hidden, config.n_routed_experts,
                                         correction_bias=config.scoring == "sigmoid")
        self.experts = FusedMoE(config.n_routed_experts, hidden, inter)
        self.shared_experts = (GatedMLP(hidden, inter * config.n_shared_experts,
                                        bias=config.mlp_bias)
                               if config.n_shared_experts > 0 else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = select_experts(
            self.gate(hidden_states), c.num_experts_per_tok, c.norm_topk_prob, c.scoring,
            self.gate.e_score_correction_bias, c.n_group, c.topk_group,
            c.routed_scaling_factor)  # [num_tokens, top_k] each
        out = self.experts(hidden_states, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV2Config, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.qk_rope_head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling,
                                 is_neox_style=not config.rope_interleave)
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.self_attn = MultiHeadLatentAttention(
            config.hidden_size, config.num_attention_heads,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            kv_lora_rank=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
            rotary=rotary, scale=mla_softmax_scale(qk_head_dim, config.rope_scaling),
            attention_bias=config.attention_bias)
        self.mlp: nn.Module
        if config.sparse_layers[layer_idx]:
            self.mlp = DeepseekV2MoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                                bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekV2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2, V2-Lite and V3 (``DeepseekV2Config`` or ``DeepseekV3Config``)."""

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV2Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names; routed experts one tensor per
        expert projection or stacked per projection); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        return load_packed_weights(self, self._without_mtp(weights), PACKED_GATE_UP, skip)

    def _without_mtp(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without DeepSeek-V3's multi-token-prediction layers: they are
        stored as decoder layers past the last one (``model.layers.{num_hidden_layers}.*``
        and on, ``num_nextn_predict_layers`` of them) and belong to the MTP draft model,
        whose proposer loads them itself; this model neither builds nor loads them."""
        first_mtp = self.config.num_hidden_layers
        for name, tensor in weights:
            parts = name.split(".", 3)
            if (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                    and int(parts[2]) >= first_mtp):
                continue
            yield name, tensor
