"""Gemma 2, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step.

Against Llama: every norm is Gemma's ``(1 + w)`` RMSNorm and each layer has four of them
(before and after attention, before and after the MLP); the embedding is scaled by
sqrt(hidden_size) in the model's dtype; attention scales by ``query_pre_attn_scalar ** -0.5``
and soft-caps its scores (``attn_logit_softcapping``), and the logits are soft-capped too
(``final_logit_softcapping``); layers alternate sliding-window (even) and global (odd)
attention; the MLP gate is tanh-approximated GELU (``hidden_activation``).

From GGUF (llama.cpp's ``gemma2``): the converter stores every norm weight as ``w + 1``
(undone on load) and drops ``lm_head``; what the file does not say is taken as llama.cpp
takes it (``_gguf_config``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import UnsupportedActivationError, check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader, layer_types, rope_settings, windows_of
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

_ABSENT = object()


# ---- config helpers the Gemma files share ----------------------------------------------

def optional_positive(r: ConfigReader, key: str, default: float | None) -> float | None:
    """A soft cap or window as transformers reads it: the class default when the key is
    absent, None when it is null (transformers' "off"), else a positive number."""
    value = r.cfg.get(key, _ABSENT)
    if value is _ABSENT:
        return default
    if value is None:
        return None
    number = r.get(key, None, float)
    if not number > 0:
        raise ConfigError(f"{r.architecture} config {key!r} must be positive or null, "
                          f"got {value!r}")
    return number


def gemma_fields(r: ConfigReader, architecture: str, defaults: dict[str, Any],
                 layer_windows: tuple[int | None, ...]) -> dict[str, Any]:
    """The ``TextModelConfig`` fields of a Gemma text config. Gemma configs leave many keys
    out (the original gemma-3-4b-it names five) and transformers fills them from its config
    class, so each key falls back to that class's default (``defaults``)."""
    def get(key: str, kind: type = int) -> Any:
        return r.get(key, defaults[key], kind)

    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), \
        get("num_hidden_layers")
    if min(hidden, heads, layers) <= 0:
        raise ConfigError(f"{architecture} config: hidden_size, num_attention_heads and "
                          f"num_hidden_layers must be positive, got {hidden}, {heads}, {layers}")
    return dict(
        architectures=[architecture],
        model_type=str(r.get("model_type", "")),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads"),
        head_dim=get("head_dim"),
        max_position_embeddings=get("max_position_embeddings"),
        vocab_size=get("vocab_size"),
        tie_word_embeddings=r.get("tie_word_embeddings", True, bool),
        layer_windows=layer_windows,
    )


def gated_gelu(r: ConfigReader) -> str:
    """The MLP gate, from ``hidden_activation`` (transformers' Gemma 2 and later read
    only that key; a ``hidden_act`` beside it is not used)."""
    name = str(r.get("hidden_activation", "gelu_pytorch_tanh"))
    try:
        return check_activation(name, f"{r.architecture} config 'hidden_activation'",
                                gated=True)
    except UnsupportedActivationError as e:
        raise ConfigError(str(e)) from None


def refuse_bidirectional(r: ConfigReader) -> None:
    r.refuse("use_bidirectional_attention", unless=False,
             why="bidirectional attention is for embedding models; this engine generates "
                 "text causally")


def embed_scale(hidden_size: int) -> float:
    """sqrt(hidden_size) as Hugging Face holds it: a float32 tensor (rounded again to the
    model's dtype where it multiplies, ``scale_embeddings``)."""
    return float(np.float32(hidden_size ** 0.5))


@functools.lru_cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype, device="cpu"))


def scale_embeddings(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x times ``scale`` rounded to x's dtype first, as Hugging Face's Gemma embeddings
    multiply (a Python number, so CUDA graph capture sees no host-to-device copy)."""
    return x * _in_dtype(scale, x.dtype)


@dataclass(frozen=True)
class Gemma2Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o projections carry biases
    hidden_activation: str  # the MLP gate
    query_pre_attn_scalar: float  # attention scores scale by its inverse square root
    attn_logit_softcapping: float | None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap)

    # transformers' Gemma2Config defaults, for the keys a config.json leaves out
    DEFAULTS: ClassVar[dict[str, int]] = dict(
        vocab_size=256_000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Gemma2Config:
        r = ConfigReader(cfg, architecture)
        refuse_bidirectional(r)
        r.refuse("partial_rotary_factor", unless=1.0, why="Gemma 2 rotates whole heads")
        layers = r.get("num_hidden_layers", cls.DEFAULTS["num_hidden_layers"], int)
        # even layers slide, odd layers see everything (transformers' default)
        kinds = layer_types(r, layers, ["sliding_attention" if (i + 1) % 2 else
                                        "full_attention" for i in range(layers)])
        window = optional_positive(r, "sliding_window", 4096)
        theta, scaling = rope_settings(r)
        return cls(**gemma_fields(r, architecture, cls.DEFAULTS,
                                  windows_of(kinds, None if window is None else int(window))),
                   intermediate_size=r.get("intermediate_size",
                                           cls.DEFAULTS["intermediate_size"], int),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   hidden_activation=gated_gelu(r),
                   query_pre_attn_scalar=r.get("query_pre_attn_scalar", 256, float),
                   attn_logit_softcapping=optional_positive(r, "attn_logit_softcapping", 50.0),
                   final_logit_softcapping=optional_positive(r, "final_logit_softcapping",
                                                             30.0))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Gemma2Config, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, scale=config.query_pre_attn_scalar ** -0.5,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            sliding_window=config.layer_windows[layer_idx],
            logit_softcap=config.attn_logit_softcapping)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            act=config.hidden_activation)
        eps = config.rms_norm_eps
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


class Gemma2Model(nn.Module):
    def __init__(self, config: Gemma2Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = embed_scale(config.hidden_size)
        self.layers = nn.ModuleList(
            [Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = scale_embeddings(self.embed_tokens(input_ids), self.embed_scale)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config: Gemma2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma2Model(config)
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
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF (llama.cpp's gemma2 and gemma3) -----------------------------------------------

# blk.N.<llama.cpp name> -> the Gemma layer's norms (q/k norms: gemma3 only)
GEMMA_GGUF_BLOCK_PARTS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def undo_norm_shift(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Gemma converters write every ``*norm.weight`` as ``w + 1`` (its RMSNorm
    multiplies by the weight as stored); the model holds Gemma's ``w``."""
    return tensor - 1 if hf_name.endswith("norm.weight") else tensor


def gguf_sliding_layers(ckpt: GGUFMetadata, num_layers: int, period: int) -> list[str]:
    """Per-layer kinds as llama.cpp reads them: ``<arch>.attention.sliding_window_pattern``
    as one flag per layer, or as a period n (every n-th layer global, 0: all sliding),
    else the architecture's own period."""
    key = f"{ckpt.architecture}.attention.sliding_window_pattern"
    pattern = ckpt.metadata(key)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ConfigError(f"{ckpt.path}: {key} has {len(pattern)} entries for "
                              f"{num_layers} layers")
        flags = [bool(p) for p in pattern]
    else:
        n = period if pattern is None else int(pattern)
        flags = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def gguf_query_scalar(ckpt: GGUFMetadata, common: dict[str, Any], big_layers: int) -> int:
    """query_pre_attn_scalar, which GGUF does not store: llama.cpp takes hidden_size /
    heads for the 27B model (``big_layers`` blocks) and head_dim for every other size,
    as the published configs have it."""
    if common["num_hidden_layers"] == big_layers:
        return common["hidden_size"] // common["num_attention_heads"]
    return common["head_dim"]


def _gguf_config(ckpt: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    arch = ckpt.architecture
    layers = common["num_hidden_layers"]
    swa_base = ckpt.metadata(f"{arch}.rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != common.get("rope_theta", 10000.0):
        raise ConfigError(f"{ckpt.path}: {arch}.rope.freq_base_swa={swa_base} differs from "
                          f"{arch}.rope.freq_base; Gemma 2 rotates every layer alike")
    return {
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's GELU is the tanh form
        "sliding_window": int(common.get("sliding_window", 4096)),
        "layer_types": gguf_sliding_layers(ckpt, layers, 2),
        "query_pre_attn_scalar": gguf_query_scalar(ckpt, common, 46),
        # llama.cpp caps both, at these values unless the file says otherwise
        "attn_logit_softcapping": float(ckpt.metadata(f"{arch}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(ckpt.metadata(f"{arch}.final_logit_softcapping",
                                                       30.0)),
    }


GGUF_ARCH = GGUFArch(config=_gguf_config, block_parts=GEMMA_GGUF_BLOCK_PARTS,
                     transform=undo_norm_shift)
