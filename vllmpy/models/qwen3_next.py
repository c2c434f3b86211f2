"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: hybrid decoders whose layers mix Gated DeltaNet
linear attention (``linear_attn``, ``vllmpy.layers.gated_deltanet``) with gated full
attention (``self_attn``), in the pattern ``layer_types`` names (else every
``full_attention_interval``-th layer is a full one: three linear layers to one full one by
default). Read top to bottom like the Hugging Face modeling files.

- Full attention: ``q_proj`` gives each head its query and a gate [2 * head_dim], q and k
  take a per-head RMSNorm, the first ``partial_rotary_factor`` of each head rotates (a
  quarter by default), and sigmoid(gate) multiplies the attention output before ``o_proj``.
- MLP: a sparse MoE with a shared expert scaled by sigmoid(``shared_expert_gate``(x))
  (Qwen3-Next on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``, a
  dense MLP on the rest; Qwen3.5-MoE on every layer, top-k always renormalised), or a
  dense gated MLP on every layer (Qwen3.5).
- Every RMSNorm outside the linear layers is zero-centred, (1 + w) * normalized(x)
  (``GemmaRMSNorm``'s arithmetic).
- Qwen3.5's M-RoPE (``mrope_section``): a text-only sequence gives its three position
  axes the same position, where M-RoPE is the plain rotary embedding, which is run here.

One model class serves the three families; their configs differ in the layers' MLPs and
in the linear layers' input projections (Qwen3-Next's fused in_proj_qkvz / in_proj_ba by
key head; Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Qwen3.5 configs may
nest the text model under ``text_config``; it is read from there.
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
from vllmpy.layers.attention import Attention, KVScaleLoader
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.gated_deltanet import (
    QWEN3_5_PACKED,
    GatedDeltaNet,
    gated_deltanet_state_spec,
)
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import SparseMoeBlock
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

LINEAR, FULL = "linear_attention", "full_attention"
# output_gate_type -> the linear layers' gate activation (swish is silu's other name)
OUTPUT_GATES = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}
MROPE_KEYS = ("mrope_section", "mrope_interleaved")


# ---- configs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Qwen3NextConfig(TextModelConfig):
    layer_kinds: tuple[str, ...]  # per layer: linear_attention or full_attention
    projections: str  # the linear layers' input projections (GatedDeltaNet's two layouts)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    output_gate_type: str  # the linear layers' gate activation: silu or sigmoid
    intermediate_size: int  # the dense MLPs'
    moe_intermediate_size: int  # each routed expert's
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: the MoE MLP (else the dense one)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int  # the dims of each full-attention head that rotate
    attention_bias: bool

    PROJECTIONS = "qkvz_grouped"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen3NextConfig:
        r, fields = _common(cfg, architecture, cls.PROJECTIONS)
        layers = fields["num_hidden_layers"]
        experts = r.get("num_experts", 512, int)
        step = r.get("decoder_sparse_step", 1, int)
        if step < 1:
            raise ConfigError(f"{architecture} config 'decoder_sparse_step'={step} must be "
                              ">= 1")
        dense = r.get("mlp_only_layers", [], list)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
            raise ConfigError(f"{architecture} config 'mlp_only_layers'={dense!r} must list "
                              "layer indices")
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                       for i in range(layers))
        return cls(**fields, **_moe(r, experts, sparse, r.get("norm_topk_prob", True, bool)),
                   intermediate_size=r.get("intermediate_size", 5632, int))

    def layer_cache_specs(self) -> tuple[CacheSpec, ...]:
        """Per linear layer its Gated DeltaNet state, per full layer its paged K/V."""
        linear = gated_deltanet_state_spec(
            self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
            self.linear_value_head_dim, self.linear_conv_kernel_dim)
        full = PagedKVSpec(self.num_key_value_heads, self.head_dim, None)
        return tuple(linear if kind == LINEAR else full for kind in self.layer_kinds)


@dataclass(frozen=True)
class Qwen3_5Config(Qwen3NextConfig):
    """Qwen3.5 (dense): a gated MLP of ``intermediate_size`` on every layer."""

    PROJECTIONS = "qkv_z_b_a"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen3_5Config:
        r, fields = _common(cfg, architecture, cls.PROJECTIONS)
        layers = fields["num_hidden_layers"]
        return cls(**fields, intermediate_size=r.get("intermediate_size", 12288, int),
                   moe_intermediate_size=0, shared_expert_intermediate_size=0, num_experts=0,
                   num_experts_per_tok=0, norm_topk_prob=False,
                   sparse_layers=(False,) * layers)


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE: the MoE MLP with its shared expert on every layer, the top-k
    probabilities always renormalised (transformers' router for this family reads no
    ``norm_topk_prob``)."""

    PROJECTIONS = "qkv_z_b_a"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen3_5MoeConfig:
        r, fields = _common(cfg, architecture, cls.PROJECTIONS)
        experts = r.get("num_experts", 256, int)
        if experts < 1:
            raise ConfigError(f"{architecture} config 'num_experts'={experts}: every layer "
                              "is a MoE layer, at least one expert is needed")
        sparse = (True,) * fields["num_hidden_layers"]
        return cls(**fields, **_moe(r, experts, sparse, True), intermediate_size=0)


def _text(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: ``text_config``'s keys over the outer ones when nested."""
    inner = cfg.get("text_config")
    if not isinstance(inner, dict):
        return cfg
    outer = {k: v for k, v in cfg.items() if k != "text_config"}
    return {**outer, **inner, "architectures": cfg.get("architectures")}


def _layer_kinds(r: ConfigReader, layers: int) -> list[str]:
    kinds = r.cfg.get("layer_types")
    if kinds is None:
        interval = r.get("full_attention_interval", 4, int)
        if interval < 1:
            raise ConfigError(f"{r.architecture} config 'full_attention_interval'={interval} "
                              "must be >= 1")
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ConfigError(f"{r.architecture} config 'layer_types' must list one kind per "
                          f"layer ({layers}), got {kinds!r}")
    for kind in kinds:
        if kind not in (LINEAR, FULL):
            raise ConfigError(f"{r.architecture} config 'layer_types' entry {kind!r} is not "
                              f"supported; supported: {LINEAR!r}, {FULL!r}")
    return list(kinds)


def _output_gate(r: ConfigReader) -> str:
    """``output_gate_type``: absent is silu; a present value must be one of the names
    (null or empty included: a present key is a value, not an absence)."""
    if "output_gate_type" not in r.cfg:
        return "silu"
    value = r.cfg["output_gate_type"]
    if not isinstance(value, str) or value not in OUTPUT_GATES:
        raise ConfigError(f"{r.architecture} config 'output_gate_type'={value!r} is not "
                          f"supported; supported: {', '.join(map(repr, OUTPUT_GATES))} "
                          "(absent: 'silu')")
    return OUTPUT_GATES[value]


def _rotary(r: ConfigReader, head_dim: int) -> dict[str, Any]:
    """rope_theta, rope_scaling and rotary_dim; M-RoPE's sections are left out (the module
    docstring says why), the partial factor is 0.25 when the config names none (as
    transformers' default for these families)."""
    params = r.cfg.get("rope_parameters")
    params = {k: v for k, v in params.items() if k not in MROPE_KEYS} \
        if isinstance(params, dict) else None
    factor = (params or {}).get("partial_rotary_factor",
                                r.cfg.get("partial_rotary_factor", 0.25))
    theta, scaling = rope_settings(ConfigReader({**r.cfg, "rope_parameters": params},
                                                r.architecture))
    rotary_dim = int(head_dim * factor) if isinstance(factor, (int, float)) else 0
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"{r.architecture} config 'partial_rotary_factor'={factor!r} is not "
                          f"supported: head_dim {head_dim} times it must be an even number "
                          f"of dims in (0, {head_dim}]")
    return dict(rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim)


def _common(cfg: dict[str, Any], architecture: str, projections: str
            ) -> tuple[ConfigReader, dict[str, Any]]:
    """The reader and the fields the three families share: geometry, layer kinds, the
    linear layers, attention and rotary settings."""
    r = ConfigReader(_text(cfg), architecture)
    r.expect("hidden_act", ("silu",), "silu")
    r.refuse("attn_output_gate", unless=True,
             why="the full-attention layers always gate their output")
    fields = decoder_fields(r, architecture, head_dim=r.get("head_dim", 256, int))
    fields["max_position_embeddings"] = r.get("max_position_embeddings", 32768, int)
    layers = fields["num_hidden_layers"]
    k_heads = r.get("linear_num_key_heads", 16, int)
    v_heads = r.get("linear_num_value_heads", 32, int)
    if k_heads < 1 or v_heads % k_heads:
        raise ConfigError(f"{architecture} config 'linear_num_value_heads'={v_heads} must be "
                          f"a multiple of 'linear_num_key_heads' ({k_heads})")
    kernel = r.get("linear_conv_kernel_dim", 4, int)
    if kernel < 2:
        raise ConfigError(f"{architecture} config 'linear_conv_kernel_dim'={kernel} is not "
                          "supported (at least 2)")
    fields.update(
        layer_kinds=tuple(_layer_kinds(r, layers)), projections=projections,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=r.get("linear_key_head_dim", 128, int),
        linear_value_head_dim=r.get("linear_value_head_dim", 128, int),
        linear_conv_kernel_dim=kernel, output_gate_type=_output_gate(r),
        rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
        attention_bias=r.get("attention_bias", False, bool),
        **_rotary(r, fields["head_dim"]))
    return r, fields


def _moe(r: ConfigReader, experts: int, sparse: tuple[bool, ...], renormalize: bool
         ) -> dict[str, Any]:
    top_k = r.get("num_experts_per_tok", 10, int)
    shared = r.get("shared_expert_intermediate_size", 512, int)
    if any(sparse):
        if not 1 <= top_k <= experts:
            raise ConfigError(f"{r.architecture} config 'num_experts_per_tok'={top_k} must "
                              f"lie in 1..num_experts ({experts})")
        if shared < 1:
            raise ConfigError(f"{r.architecture} config 'shared_expert_intermediate_size'="
                              f"{shared} is not supported: the MoE layers always carry a "
                              "shared expert")
    return dict(moe_intermediate_size=r.get("moe_intermediate_size", 512, int),
                shared_expert_intermediate_size=shared, num_experts=experts,
                num_experts_per_tok=top_k, norm_topk_prob=renormalize, sparse_layers=sparse)


# ---- the model -------------------------------------------------------------------------

class Qwen3NextAttention(nn.Module):
    """Gated full attention. ``qkv_proj`` packs the checkpoint's q_proj (per head: the
    query, then its gate), k_proj and v_proj."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": 2 * self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling,
                                          rotary_dim=config.rotary_dim)
        self.attn = Attention(heads, kv_heads, head_dim, head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        n = hidden_states.shape[0]
        q_gate, k, v = self.qkv_proj(hidden_states).split(
            [2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        # [num_tokens, heads, 2 * head_dim] -> the query and the gate, each [.., head_dim]
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).reshape(n, self.q_size)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, attn_metadata)  # [num_tokens, heads * head_dim]
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, self.q_size)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3NextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_kinds[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim,
                config.linear_conv_kernel_dim, eps=config.rms_norm_eps,
                projections=config.projections, gate_activation=config.output_gate_type)
        else:
            self.self_attn = Qwen3NextAttention(config)
        self.mlp: nn.Module
        if config.sparse_layers[layer_idx]:
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.num_experts, config.moe_intermediate_size,
                config.num_experts_per_tok, config.norm_topk_prob,
                shared_intermediate_size=config.shared_expert_intermediate_size,
                shared_gate=True)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == LINEAR:
            hidden_states = self.linear_attn(hidden_states, attn_metadata)
        else:
            hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3NextModel(nn.Module):
    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3NextDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _without_mtp(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    # The multi-token-prediction head (``mtp.*``) is a draft model: the MTP proposer loads
    # it (vllmpy.spec_decode); the target model has no parameter for it.
    return ((name, t) for name, t in weights if not name.startswith("mtp."))


class Qwen3NextForCausalLM(nn.Module):
    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3NextModel(config)
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
        packed = {**PACKED_QKV_GATE_UP, **QWEN3_5_PACKED}
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(_without_mtp(weights)), packed,
                                   skip) | scales.loaded
