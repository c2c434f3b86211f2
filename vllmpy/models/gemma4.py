"""Gemma 4's text model (``Gemma4ForCausalLM``), read top to bottom like transformers'
``modeling_gemma4``, over the flattened tokens of one engine step.

Against Gemma 3: the norms are plain-weight RMSNorms (``w``, not ``1 + w``, the product
taken in fp32 before the one rounding), values get a weightless RMSNorm per head beside
the q and k norms, attention does not scale its scores (scale 1.0), each layer's output
is multiplied by its ``layer_scalar``, and the last layer is always global. The global
layers rotate with "proportional" RoPE by default: the first
``partial_rotary_factor * head_dim / 2`` frequencies of the whole head's spectrum turn and
the rest stand still. With ``attention_k_eq_v`` the global layers have no v projection:
the values are the keys' projection (before the key norm).

Not built, and refused by name when a config enables them: per-layer embeddings
(``hidden_size_per_layer_input``, on by default in transformers), KV sharing across
layers (``num_kv_shared_layers``), the MoE block (``enable_moe_block``), bidirectional
attention (``use_bidirectional_attention="all"``), and layers whose head size or KV head
count differ from the others' (``global_head_dim`` / ``num_global_key_value_heads`` /
``per_layer_config``): the paged KV cache holds one head geometry for every layer. The
published Gemma 4 checkpoints use per-layer embeddings or a 512-wide global head, so
today this serves configs built without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import Attention, KVScaleLoader
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, PackedLinear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.rotary import RotaryEmbedding, check_rope_scaling
from vllmpy.models.config_reader import ConfigReader, layer_types, windows_of
from vllmpy.models.gemma2 import (
    embed_scale,
    gated_gelu,
    gemma_fields,
    optional_positive,
    scale_embeddings,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

# transformers' defaults: sliding layers rotate whole heads, global ones proportionally
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}
_PROPORTIONAL_FIELDS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}


def _check_rope(params: Any, where: str, architecture: str) -> dict[str, Any]:
    """One layer kind's rope settings, checked against what ``gemma4_rotary`` builds."""
    if not isinstance(params, dict):
        raise ConfigError(f"{architecture} config {where}={params!r} must be a dict of rope "
                          "settings")
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{architecture} config {where}.rope_theta={theta!r} must be a "
                          "positive number")
    kind = params.get("rope_type", params.get("type", "default"))
    prf = params.get("partial_rotary_factor")
    if kind == "proportional":
        extra = sorted(set(params) - _PROPORTIONAL_FIELDS)
        prf = 1.0 if prf is None else prf
        factor = params.get("factor", 1.0)
        if extra or not 0 < prf <= 1 or not factor > 0:
            raise ConfigError(f"{architecture} config {where}={params!r}: proportional rope "
                              "takes rope_theta, partial_rotary_factor in (0, 1] and a "
                              "positive factor only")
    elif kind == "default" and prf not in (None, 1.0):
        # transformers' default rope ignores the factor; refused rather than guessed
        raise ConfigError(f"{architecture} config {where}.partial_rotary_factor={prf!r} "
                          "with rope_type 'default' is not supported")
    elif kind != "default":
        try:
            check_rope_scaling({k: v for k, v in params.items() if k != "rope_theta"}, where)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
    return dict(params)


def _refuse_unbuilt(r: ConfigReader) -> None:
    """The Gemma 4 features this model does not build, refused by name when enabled."""
    ple = r.get("hidden_size_per_layer_input", 256, int)
    if ple:
        said = "" if r.has("hidden_size_per_layer_input") else " (transformers' default)"
        raise ConfigError(f"{r.architecture} config 'hidden_size_per_layer_input'={ple}"
                          f"{said} enables per-layer embeddings (PLE), which are not "
                          "supported; a config with 0 loads")
    r.refuse("num_kv_shared_layers", unless=0, why="KV sharing across layers")
    r.refuse("enable_moe_block", unless=False, why="the MoE block")
    r.expect("use_bidirectional_attention", ("vision",))  # vision: text stays causal
    for key in ("rope_scaling", "rope_theta", "rope_local_base_freq"):
        r.refuse(key, why="Gemma 4 reads its rotary from 'rope_parameters' only")


def _layer_geometry(r: ConfigReader, kinds: list[str], head_dim: int,
                    kv_heads: int) -> None:
    """Refuse layers whose head size or KV head count differ from the others', as
    transformers' Gemma4TextConfig would give them: ``per_layer_config`` overrides when
    the config has one, else ``global_head_dim`` (512 by default) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads`` on every global layer."""
    per_layer = r.cfg.get("per_layer_config")
    if per_layer is None:
        overrides = {"head_dim": r.get("global_head_dim", 512, int)}
        if r.get("attention_k_eq_v", False, bool) and r.has("num_global_key_value_heads"):
            overrides["num_key_value_heads"] = r.get("num_global_key_value_heads", 0, int)
        per_layer = {i: overrides for i, k in enumerate(kinds) if k == "full_attention"}
    if not isinstance(per_layer, dict):
        raise ConfigError(f"{r.architecture} config 'per_layer_config'={per_layer!r} must map "
                          "layer indices to overrides")
    for index, layer in per_layer.items():
        if not isinstance(layer, dict) or not set(layer) <= {"head_dim", "num_key_value_heads"}:
            raise ConfigError(f"{r.architecture} config per_layer_config[{index!r}]={layer!r}: "
                              "only head_dim and num_key_value_heads overrides are supported")
        got = (layer.get("head_dim", head_dim), layer.get("num_key_value_heads", kv_heads))
        if got != (head_dim, kv_heads):
            raise ConfigError(
                f"{r.architecture} config: layer {index} has head_dim {got[0]} and {got[1]} KV "
                f"heads where the others have {head_dim} and {kv_heads} (global_head_dim / "
                "num_global_key_value_heads / per_layer_config); the paged KV cache holds one "
                "head geometry for every layer, so mixed geometries are not supported")


@dataclass(frozen=True)
class Gemma4Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool  # q, k, v and o projections carry biases
    hidden_activation: str  # the MLP gate
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap); None: off
    attention_k_eq_v: bool  # global layers take their values from the key projection
    layer_types: tuple[str, ...]  # each layer's kind: sliding_attention / full_attention
    rope: dict[str, dict[str, Any]]  # layer kind -> its rope_parameters entry

    # transformers' Gemma4TextConfig defaults, for the keys a config.json leaves out
    DEFAULTS: ClassVar[dict[str, int]] = dict(
        vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131_072)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Gemma4Config:
        r = ConfigReader(cfg, architecture)
        _refuse_unbuilt(r)
        layers = r.get("num_hidden_layers", cls.DEFAULTS["num_hidden_layers"], int)
        kinds = layer_types(r, layers, ["sliding_attention" if (i + 1) % 6
                                        else "full_attention" for i in range(layers)])
        kinds[-1] = "full_attention"  # as transformers forces it
        window = optional_positive(r, "sliding_window", 512)
        fields = gemma_fields(r, architecture, cls.DEFAULTS,
                              windows_of(kinds, None if window is None else int(window)))
        _layer_geometry(r, kinds, fields["head_dim"], fields["num_key_value_heads"])
        params = r.get("rope_parameters", DEFAULT_ROPE, dict)
        rope = {kind: _check_rope(params.get(kind), f"rope_parameters.{kind}", architecture)
                for kind in sorted(set(kinds))}
        return cls(**fields,
                   intermediate_size=r.get("intermediate_size",
                                           cls.DEFAULTS["intermediate_size"], int),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   attention_bias=r.get("attention_bias", False, bool),
                   hidden_activation=gated_gelu(r),
                   final_logit_softcapping=optional_positive(r, "final_logit_softcapping",
                                                             None),
                   attention_k_eq_v=r.get("attention_k_eq_v", False, bool),
                   layer_types=tuple(kinds), rope=rope)


class Gemma4RMSNorm(nn.Module):
    """``x * (mean(x^2) + eps) ** -0.5``, times ``weight`` when the norm has one, in fp32
    and rounded once to x's dtype (transformers' Gemma4RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = (nn.Parameter(torch.empty(hidden_size), requires_grad=False)
                       if with_scale else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """transformers' "proportional" RoPE: the whole head rotates in halves (NeoX style)
    with frequencies ``base ** (-2i / head_dim)`` for the first
    ``int(partial_rotary_factor * head_dim // 2)`` pairs and zero for the rest, all
    divided by ``factor``. The base class's kernels and tables serve it unchanged."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 partial_rotary_factor: float, factor: float = 1.0) -> None:
        super().__init__(head_dim, max_position, base)
        self.rotated_pairs = int(partial_rotary_factor * head_dim // 2)
        self.factor = factor

    def _settings(self, device: torch.device) -> tuple[Any, ...]:
        # its own tables: not those of a plain rotary of the same head and base
        return (*super()._settings(device), "proportional", self.rotated_pairs, self.factor)

    def _cos_sin(self) -> torch.Tensor:
        """[max_position, head_dim] float32: cos of the angles, then sin."""
        pairs = self.rotated_pairs
        exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = torch.cat([1.0 / (self.base ** exponents),
                              torch.zeros(self.head_dim // 2 - pairs)]) / self.factor
        angles = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


def gemma4_rotary(params: dict[str, Any], head_dim: int, max_position: int
                  ) -> RotaryEmbedding:
    """The rotary of one layer kind from its (checked) rope_parameters entry."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params["rope_theta"])
    if kind == "proportional":
        return ProportionalRotaryEmbedding(head_dim, max_position, theta,
                                           params.get("partial_rotary_factor", 1.0),
                                           params.get("factor", 1.0))
    if kind == "default":
        return RotaryEmbedding(head_dim, max_position, theta)
    return RotaryEmbedding(head_dim, max_position, theta,
                           {k: v for k, v in params.items() if k != "rope_theta"})


class Gemma4Attention(nn.Module):
    """q, k and v packed (``qkv_proj``), per-head norms on all three (the value norm
    without a weight), rotary on q and k, unscaled scores, ``o_proj``."""

    def __init__(self, config: Gemma4Config, layer_idx: int) -> None:
        super().__init__()
        kind = config.layer_types[layer_idx]
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        bias, eps = config.attention_bias, config.rms_norm_eps
        self.qkv_proj = PackedLinear(
            config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(head_dim, eps)
        self.k_norm = Gemma4RMSNorm(head_dim, eps)
        self.v_norm = Gemma4RMSNorm(head_dim, eps, with_scale=False)
        self.rotary_emb = gemma4_rotary(config.rope[kind], head_dim,
                                        config.max_position_embeddings)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=1.0,
                              sliding_window=config.layer_windows[layer_idx])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = q.shape[0]  # [num_tokens, heads, head_dim] for the norms and rotary
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        v = self.v_norm(v.reshape(n, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), attn_metadata)
        return self.o_proj(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = Gemma4RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps)
        # a checkpoint tensor (transformers' buffer): the layer's output is scaled by it
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        hidden_states = residual + self.post_feedforward_layernorm(hidden_states)
        return hidden_states * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = embed_scale(config.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = scale_embeddings(self.embed_tokens(input_ids), self.embed_scale)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


def _values_from_keys(weights: Iterable[tuple[str, torch.Tensor]], layers: set[int]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """With ``attention_k_eq_v`` the global layers' values are their keys' projection:
    each such layer's ``k_proj`` tensors are loaded into the v rows as well."""
    for name, tensor in weights:
        yield name, tensor
        parts = name.split(".")
        if (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3:5] ==
                ["self_attn", "k_proj"] and parts[2].isdigit() and int(parts[2]) in layers):
            yield ".".join([*parts[:4], "v_proj", parts[5]]), tensor


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma4Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out,
                           softcap=self.config.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        config = self.config
        if config.attention_k_eq_v:
            weights = _values_from_keys(weights, {
                i for i, kind in enumerate(config.layer_types) if kind == "full_attention"})
        skip: tuple[str, ...] = ()
        if config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded
