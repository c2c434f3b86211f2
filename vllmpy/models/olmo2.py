"""OLMo-2, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step. OLMo-3 (``vllmpy.models.olmo3``) is this model under its own
config converter.

Against Llama: the norms come after the sublayers, not before: each layer adds
``post_attention_layernorm(attention(x))`` and then ``post_feedforward_layernorm(mlp(x))``
to the residual stream, with nothing normalising the sublayers' inputs; q and k are each
RMS-normalised over the whole projection (all heads together) before rotary. Each layer
may have its own rope settings and sliding window (OLMo-3).

From GGUF (llama.cpp's ``olmo2``, which OLMo-3 files also use): ``post_attention_norm``,
``post_ffw_norm``, ``attn_q_norm`` and ``attn_k_norm`` beside the common names, q/k rows
as in Hugging Face. A file with ``olmo2.attention.sliding_window_pattern`` is an OLMo-3
(see ``_gguf_config``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import UnsupportedActivationError, check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

# (rope theta, rope scaling or None) of one layer
LayerRope = tuple[float, dict[str, Any] | None]


def gated_act(r: ConfigReader) -> str:
    """``hidden_act``, the gate of the MLP (default silu), if the engine runs it."""
    try:
        return check_activation(r.get("hidden_act", "silu", str), "hidden_act", gated=True)
    except UnsupportedActivationError as e:
        raise ConfigError(f"{r.architecture} config: {e}") from None


@dataclass(frozen=True)
class Olmo2Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # the MLP gate's activation
    attention_bias: bool  # q, k, v and o carry biases
    layer_ropes: tuple[LayerRope, ...]  # each layer's rope

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Olmo2Config:
        r = ConfigReader(cfg, architecture)
        fields = decoder_fields(r, architecture)
        rope = rope_settings(r)
        return cls(**fields, intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float), hidden_act=gated_act(r),
                   attention_bias=r.get("attention_bias", False, bool),
                   layer_ropes=(rope,) * fields["num_hidden_layers"])


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: Olmo2Config, layer_idx: int) -> None:
        super().__init__()
        theta, scaling = config.layer_ropes[layer_idx]
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, theta,
                                 scaling)
        # q_norm / k_norm span all heads of the projection: [num_heads * head_dim]
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, qk_norm=partial(RMSNorm, eps=config.rms_norm_eps),
            qk_norm_per_head=False, sliding_window=config.layer_windows[layer_idx])
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(hidden_states)
        return residual + self.post_feedforward_layernorm(hidden_states)


class Olmo2Model(nn.Module):
    def __init__(self, config: Olmo2Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Olmo2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


class Olmo2ForCausalLM(nn.Module):
    def __init__(self, config: Olmo2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Olmo2Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF: llama.cpp's "olmo2" (OLMo-2 and OLMo-3) -------------------------------------

def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """Whether q, k, v and o carry biases (the tensors say). llama.cpp's converter writes
    OLMo-3 as ``olmo2`` plus its sliding window and a per-layer pattern (true: sliding);
    such a file loads as ``Olmo3ForCausalLM``, its global layers taking the file's rope
    scaling and rope.freq_base, its sliding layers unscaled at rope.freq_base_swa (else
    the same base)."""
    arch = meta.architecture
    extra = {"attention_bias": "blk.0.attn_q.bias" in meta.tensor_names}  # not in metadata
    pattern = meta.metadata(f"{arch}.attention.sliding_window_pattern")
    window = meta.metadata(f"{arch}.attention.sliding_window")
    if pattern is None:
        if window is not None:
            raise ConfigError(f"{meta.path}: {arch}.attention.sliding_window={window} without "
                              f"{arch}.attention.sliding_window_pattern: which layers slide "
                              "is not said")
        return extra
    layers = config["num_hidden_layers"]
    if not isinstance(pattern, list) or len(pattern) != layers or window is None:
        raise ConfigError(f"{meta.path}: {arch}.attention.sliding_window_pattern={pattern!r} "
                          f"must list one flag per layer ({layers}) beside "
                          f"{arch}.attention.sliding_window (got {window!r})")
    theta = config.get("rope_theta", 10000.0)
    full = {"rope_type": "default", **(config.get("rope_scaling") or {}), "rope_theta": theta}
    swa_theta = meta.metadata(f"{arch}.rope.freq_base_swa")
    sliding = {"rope_type": "default",
               "rope_theta": theta if swa_theta is None else float(swa_theta)}
    return {**extra, "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "sliding_window": int(window), "rope_scaling": None, "rope_theta": None,
            "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
            "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}


GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"post_attention_norm": "post_attention_layernorm",
                                  "post_ffw_norm": "post_feedforward_layernorm",
                                  "attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"})
