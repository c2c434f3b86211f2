"""PhiMoE (Phi-3.5-MoE), read top to bottom like the Hugging Face modeling file, over the
flattened tokens of one engine step.

Against Mixtral: LayerNorms with biases (their eps is the config's ``rms_norm_eps``),
optional biases on q, k, v and o (``attention_bias``) and on the head (``lm_head_bias``),
LongRoPE with the config's own ``short_mscale`` / ``long_mscale``, and the router's top-2
chosen by the **sparsemixer** (``sparsemixer_top2``) instead of a softmax over all experts.
The experts are ``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up) and ``w2`` (down);
transformers 5's own names (``mlp.router``, ``mlp.experts.gate_up_proj`` / ``down_proj``)
load too.

Rotation past ``original_max_position_embeddings`` follows the rotary layer's LongRoPE
table (long factors and ``long_mscale`` from that position on, as vLLM does); transformers'
PhiMoE keeps the short factors there and switches a whole sequence to ``long_mscale``, so
the two agree only within the original length. ``input_jitter_noise`` and the router's
sampling apply in training only. llama.cpp's ``phimoe`` GGUF files are not read.
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
from vllmpy.layers.linear import Linear
from vllmpy.layers.moe import FusedMoE, mark_router
from vllmpy.layers.norm import LayerNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
TOP_K = 2  # the sparsemixer picks exactly two experts per token


def sparsemixer_top2(logits: torch.Tensor,
                     jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparsemixer's inference-time choice: routing weights (fp32) and expert ids
    (int64), both [T, 2], of router logits [T, E].

    The first expert is the argmax; its weight is its softmax probability among the experts
    whose logit lies within ``2 * jitter_eps`` of the best, relative to max(|logit|, best).
    The second is the argmax of the others, weighted the same way among the others near
    it. The two weights are not renormalised."""
    scores = logits.float()
    best, first = scores.max(dim=-1, keepdim=True)  # [T, 1] each
    w_first = _weight_near_best(scores, scores, best, first, jitter_eps)
    others = scores.scatter(-1, first, float("-inf"))
    second_best, second = others.max(dim=-1, keepdim=True)
    w_second = _weight_near_best(others, scores, second_best, second, jitter_eps)
    return torch.cat((w_first, w_second), dim=-1), torch.cat((first, second), dim=-1)


def _weight_near_best(candidates: torch.Tensor, scores: torch.Tensor, best: torch.Tensor,
                      chosen: torch.Tensor, jitter_eps: float) -> torch.Tensor:
    """Softmax of ``candidates`` with every expert too far below ``best`` masked out, at
    ``chosen`` [T, 1]; the distance is measured on the raw ``scores``."""
    scale = scores.abs().clamp(min=best)  # [T, E]
    too_far = (best - scores) / scale > 2 * jitter_eps
    probs = torch.softmax(candidates.masked_fill(too_far, float("-inf")), dim=-1)
    return probs.gather(-1, chosen)


def _rope_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with its LongRoPE dict's ``original_max_position_embeddings`` as
    transformers' PhimoeConfig settles it: the top-level key first, then the dict's own,
    then ``max_position_embeddings``."""
    top = cfg.get("original_max_position_embeddings")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        if rope.get("rope_type", rope.get("type")) != "longrope":
            return cfg
        rope = dict(rope)
        if top is not None:
            rope["original_max_position_embeddings"] = top
        else:
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("max_position_embeddings"))
        return {**cfg, key: rope}
    return cfg


def _rope(r: ConfigReader, architecture: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, LongRoPE dict or None); theta defaults to PhimoeConfig's 1e6."""
    params = r.cfg.get("rope_parameters")
    given = (isinstance(params, dict) and params.get("rope_theta") is not None) or \
        r.has("rope_theta")
    theta, scaling = rope_settings(r)
    if not given:
        theta = 1e6
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "longrope":
        raise ConfigError(f"{architecture} config: rope type {kind!r} is not supported "
                          "(PhiMoE rotates with the default rope or LongRoPE)")
    for field in ("short_mscale", "long_mscale"):
        if scaling.get(field) is None:
            raise ConfigError(f"{architecture} config: LongRoPE needs {field!r} (PhiMoE "
                              "scales cos/sin by it); the rope dict has: "
                              f"{', '.join(sorted(scaling))}")
    return theta, scaling


@dataclass(frozen=True)
class PhimoeConfig(TextModelConfig):
    intermediate_size: int  # each expert's
    num_local_experts: int
    router_jitter_noise: float  # the sparsemixer's relative gap (2x this) at inference
    rms_norm_eps: float  # the LayerNorms' eps, under transformers' name
    attention_bias: bool  # biases on q, k, v and o
    lm_head_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or LongRoPE

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> PhimoeConfig:
        cfg = _rope_config(cfg)
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        top_k = r.get("num_experts_per_tok", TOP_K, int)
        if top_k != TOP_K:
            raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} is not "
                              f"supported: the sparsemixer routes each token to exactly "
                              f"{TOP_K} experts")
        experts = r.get("num_local_experts", 16, int)
        if experts < TOP_K:
            raise ConfigError(f"{architecture} config 'num_local_experts'={experts} must be "
                              f"at least {TOP_K}")
        jitter = r.get("router_jitter_noise", 0.01, float)
        if jitter < 0:
            raise ConfigError(f"{architecture} config 'router_jitter_noise'={jitter} must "
                              "not be negative")
        params = cfg.get("rope_parameters")
        partial = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        if partial is None:
            partial = cfg.get("partial_rotary_factor")
        if partial is not None and partial != 1.0:
            raise ConfigError(f"{architecture} config 'partial_rotary_factor'={partial!r} is "
                              "not supported (PhiMoE rotates whole heads)")
        theta, scaling = _rope(r, architecture)
        head_bias = r.get("lm_head_bias", False, bool)
        fields = decoder_fields(r, architecture)
        if fields["tie_word_embeddings"] and head_bias:
            raise ConfigError(f"{architecture} config: 'lm_head_bias' with "
                              "'tie_word_embeddings' is not supported (a tied head has no "
                              "bias of its own here); untie the head or drop its bias")
        if not r.has("max_position_embeddings"):
            fields["max_position_embeddings"] = 131072  # transformers' PhimoeConfig default
        window = r.get("sliding_window", None, int)
        return cls(**{**fields, "layer_windows": (window,) * fields["num_hidden_layers"]},
                   intermediate_size=r.get("intermediate_size", 6400, int),
                   num_local_experts=experts, router_jitter_noise=jitter,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float),
                   attention_bias=r.get("attention_bias", False, bool),
                   lm_head_bias=head_bias, rope_theta=theta, rope_scaling=scaling)


class PhimoeSparseMoeBlock(nn.Module):
    """``gate`` (the router, [E, H], no bias) and ``experts``, routed by the sparsemixer."""

    def __init__(self, config: PhimoeConfig) -> None:
        super().__init__()
        self.jitter_eps = config.router_jitter_noise
        self.gate = mark_router(Linear(config.hidden_size, config.num_local_experts))
        self.experts = FusedMoE(config.num_local_experts, config.hidden_size,
                                config.intermediate_size, EXPERT_NAMES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer_top2(self.gate(x), self.jitter_eps)
        return self.experts(x, weights, ids)


class PhimoeDecoderLayer(nn.Module):
    def __init__(self, config: PhimoeConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, sliding_window=config.layer_windows[layer_idx])
        self.block_sparse_moe = PhimoeSparseMoeBlock(config)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the embeddings are the residual
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.block_sparse_moe(hidden_states), residual


class PhimoeModel(nn.Module):
    def __init__(self, config: PhimoeConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [PhimoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# transformers 5's module names -> the checkpoint's (and this model's)
_V5_NAMES = ((".mlp.router.", ".block_sparse_moe.gate."),
             (".mlp.experts.", ".block_sparse_moe.experts."))


def _checkpoint_names(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors saved under transformers 5's names renamed to the checkpoint's; the fused
    ``experts.gate_up_proj`` / ``down_proj`` keep their names (the experts take them)."""
    for name, tensor in weights:
        for old, new in _V5_NAMES:
            name = name.replace(old, new)
        yield name, tensor


class PhimoeForCausalLM(nn.Module):
    def __init__(self, config: PhimoeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = PhimoeModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size,
                                    bias=config.lm_head_bias))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names, one tensor per expert projection,
        or transformers 5's fused experts); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(_checkpoint_names(weights)),
                                   PACKED_QKV_GATE_UP, skip) | scales.loaded
