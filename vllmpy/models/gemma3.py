"""Gemma 3, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step; also the text model of ``Gemma3ForConditionalGeneration``.

Gemma 2's layer (four ``(1 + w)`` RMSNorms, the embedding scaled by sqrt(hidden_size),
scores scaled by ``query_pre_attn_scalar ** -0.5``, a tanh-GELU gate) with a per-head
RMSNorm on q and k before rotary, and two kinds of layers: five sliding-window layers to
one global (``layer_types``, or every ``sliding_window_pattern``-th layer global), each
kind with its own rotary (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``,
or the older ``rope_local_base_freq`` / ``rope_theta`` with ``rope_scaling`` on the global
layers only: linear, factor 8, on the 4B and larger). There are no soft caps by default;
``final_logit_softcapping`` and ``attn_logit_softcapping`` are applied when set (as vLLM
and llama.cpp do; transformers' Gemma 3 applies neither cap in its multimodal model and
not the attention cap in any).

The multimodal checkpoint keeps the text model under ``language_model.model.*`` (the
original release) or ``model.language_model.*`` (transformers 4.52 on); both load, and the
vision tower and projector tensors are skipped: requests are text only.

From GGUF (llama.cpp's ``gemma3``): norms stored as ``w + 1`` (undone on load), the local
rotary base from ``gemma3.rope.freq_base_swa`` (llama.cpp's 10000 when absent), the global
one and its scaling from the common rope keys, one layer in six global unless the file
says otherwise, and no sliding window at all without ``gemma3.attention.sliding_window``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig, log
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.layers.rotary import RotaryEmbedding, check_rope_scaling
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader, layer_types, windows_of
from vllmpy.models.gemma2 import (
    GEMMA_GGUF_BLOCK_PARTS,
    embed_scale,
    gated_gelu,
    gemma_fields,
    gguf_query_scalar,
    gguf_sliding_layers,
    optional_positive,
    refuse_bidirectional,
    scale_embeddings,
    undo_norm_shift,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

MULTIMODAL = "Gemma3ForConditionalGeneration"
Rope = tuple[float, dict[str, Any] | None]  # (theta, scaling or None)


def _rope(params: dict[str, Any], where: str, architecture: str) -> Rope:
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ConfigError(f"{architecture} config {where}.rope_theta={theta!r} must be a "
                          "positive number")
    prf = params.get("partial_rotary_factor")
    if prf is not None and prf != 1.0:
        raise ConfigError(f"{architecture} config {where}.partial_rotary_factor={prf!r} is "
                          "not supported (Gemma 3 rotates whole heads)")
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in params.items()
                                              if k != "rope_theta"}
    try:
        check_rope_scaling(scaling, where)
    except ValueError as e:
        raise ConfigError(f"{architecture} config: {e}") from None
    return float(theta), scaling


def gemma3_rope(r: ConfigReader) -> dict[str, Rope]:
    """The rotary of each layer kind, as transformers' Gemma3TextConfig resolves it:
    ``rope_parameters`` keyed by layer kind, the legacy ``rope_scaling`` merged into the
    global kind's, thetas defaulting to ``rope_theta`` (1e6) for global layers and
    ``rope_local_base_freq`` (1e4) for local ones."""
    kinds = ("full_attention", "sliding_attention")
    params = r.cfg.get("rope_parameters") or {}
    if not isinstance(params, dict) or not set(params) <= set(kinds) or not all(
            isinstance(v, dict) or v is None for v in params.values()):
        raise ConfigError(f"{r.architecture} config 'rope_parameters'={params!r} must map "
                          "'full_attention' and 'sliding_attention' to their rope settings")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    legacy = r.cfg.get("rope_scaling")
    if legacy is not None:
        if not isinstance(legacy, dict):
            raise ConfigError(f"{r.architecture} config 'rope_scaling'={legacy!r} must be a "
                              "dict of rope settings")
        full.update(legacy)  # the older spelling scales the global layers only
    full.setdefault("rope_theta", r.get("rope_theta", 1_000_000.0, float))
    local.setdefault("rope_theta", r.get("rope_local_base_freq", 10_000.0, float))
    return {"full_attention": _rope(full, "rope_parameters.full_attention", r.architecture),
            "sliding_attention": _rope(local, "rope_parameters.sliding_attention",
                                       r.architecture)}


@dataclass(frozen=True)
class Gemma3Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool  # q, k, v and o projections carry biases
    hidden_activation: str  # the MLP gate
    query_pre_attn_scalar: float  # attention scores scale by its inverse square root
    attn_logit_softcapping: float | None  # scores -> cap * tanh(scores / cap); None: off
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap); None: off
    layer_types: tuple[str, ...]  # each layer's kind: sliding_attention / full_attention
    rope: dict[str, Rope]  # layer kind -> (rope theta, rope scaling or None)
    multimodal: bool  # a Gemma3ForConditionalGeneration checkpoint (text model only)

    # transformers' Gemma3TextConfig defaults, for the keys a config.json leaves out
    DEFAULTS: ClassVar[dict[str, int]] = dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131_072)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Gemma3Config:
        multimodal = architecture == MULTIMODAL
        text = cfg
        if multimodal:
            text = cfg.get("text_config")  # type: ignore[assignment]
            if not isinstance(text, dict):
                raise ConfigError(f"{architecture} config has no 'text_config' object (got "
                                  f"{text!r}); the text model's settings live there")
            # the head is tied (or not) by the top-level config, as transformers reads it
            text = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        r = ConfigReader(text, architecture)
        refuse_bidirectional(r)
        r.refuse("partial_rotary_factor", unless=1.0, why="Gemma 3 rotates whole heads")
        layers = r.get("num_hidden_layers", cls.DEFAULTS["num_hidden_layers"], int)
        period = r.get("sliding_window_pattern", 6, int)
        if period <= 0:
            raise ConfigError(f"{architecture} config 'sliding_window_pattern'={period} must "
                              "be positive")
        kinds = layer_types(r, layers, ["sliding_attention" if (i + 1) % period
                                        else "full_attention" for i in range(layers)])
        window = optional_positive(r, "sliding_window", 4096)
        return cls(**gemma_fields(r, architecture, cls.DEFAULTS,
                                  windows_of(kinds, None if window is None else int(window))),
                   intermediate_size=r.get("intermediate_size",
                                           cls.DEFAULTS["intermediate_size"], int),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   attention_bias=r.get("attention_bias", False, bool),
                   hidden_activation=gated_gelu(r),
                   query_pre_attn_scalar=r.get("query_pre_attn_scalar", 256, float),
                   attn_logit_softcapping=optional_positive(r, "attn_logit_softcapping", None),
                   final_logit_softcapping=optional_positive(r, "final_logit_softcapping",
                                                             None),
                   layer_types=tuple(kinds), rope=gemma3_rope(r), multimodal=multimodal)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        theta, scaling = config.rope[config.layer_types[layer_idx]]
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta,
                                 scaling)
        eps = config.rms_norm_eps
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, scale=config.query_pre_attn_scalar ** -0.5,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=partial(GemmaRMSNorm, eps=eps),
            sliding_window=config.layer_windows[layer_idx],
            logit_softcap=config.attn_logit_softcapping)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            act=config.hidden_activation)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual stream is hidden_states + residual; each norm that opens a block
        # adds them (vLLM's convention), the norms that close a block do not
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return self.post_feedforward_layernorm(hidden_states), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = embed_scale(config.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = scale_embeddings(self.embed_tokens(input_ids), self.embed_scale)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# the multimodal checkpoint's names of the text model -> ours, in both layouts
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.")


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A Gemma3ForConditionalGeneration checkpoint's text-model tensors under the text
    model's own names; the vision tower and projector are left out. Any other name passes
    through unchanged (the loader then names it if nothing takes it)."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))
        if config.multimodal:
            log(f"{MULTIMODAL}: serving the text model only; the vision tower and "
                "projector are not loaded and images are not served")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out,
                           softcap=self.config.final_logit_softcapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        if self.config.multimodal:
            weights = text_model_weights(weights)
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF (llama.cpp's gemma3) ----------------------------------------------------------

def _gguf_config(ckpt: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    layers = common["num_hidden_layers"]
    window = int(common.get("sliding_window") or 0)  # llama.cpp: no key (or 0), no window
    windowed = window > 0
    full = {"rope_type": "default", "rope_theta": common.get("rope_theta", 10_000.0)}
    full.update(common.get("rope_scaling") or {})  # llama.cpp scales the global layers only
    local_theta = ckpt.metadata(f"{ckpt.architecture}.rope.freq_base_swa", 10_000.0)
    final_cap = ckpt.metadata(f"{ckpt.architecture}.final_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's GELU is the tanh form
        "sliding_window": window if windowed else None,
        "layer_types": (gguf_sliding_layers(ckpt, layers, 6) if windowed
                        else ["full_attention"] * layers),
        "rope_parameters": {"full_attention": full,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": float(local_theta)}},
        "rope_scaling": None,  # folded into rope_parameters above
        "query_pre_attn_scalar": gguf_query_scalar(ckpt, common, 62),
        "attn_logit_softcapping": None,  # llama.cpp's gemma3 never caps attention
        "final_logit_softcapping": None if not final_cap else float(final_cap),
    }


GGUF_ARCH = GGUFArch(config=_gguf_config, block_parts=GEMMA_GGUF_BLOCK_PARTS,
                     transform=undo_norm_shift)
