"""GPT-OSS: attention with a learned sink logit per head (``self_attn.sinks``) in every
softmax, q/k/v/o biases and YaRN rotary, sliding-window layers alternating with full ones
(``layer_types``), and a sparse MoE MLP in every layer: a biased router whose top-k
logits are softmaxed among themselves, and experts stored fused and transposed
(``gate_up_proj`` [E, H, 2I] with gate and up interleaved, ``down_proj`` [E, I, H], both
with biases) under the clamped SwiGLU (``swiglu_limit``); read top to bottom like the
Hugging Face modeling file.

Checkpoints whose experts are MXFP4 (``quantization_config.quant_method: mxfp4``, the
released ones) have them dequantized to the model's dtype at load
(``vllmpy.layers.quantization.mxfp4``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear
from vllmpy.layers.moe import ExpertLayout, FusedMoE, mark_router, select_experts
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.quantization.mxfp4 import dequantize_pairs
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

# what transformers assumes when config.json leaves these out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_WINDOW = 128
# the experts' checkpoint form: fused gate/up [E, H, 2I] (gate, up alternating) and down
# [E, I, H], with biases
EXPERT_LAYOUT = ExpertLayout(transposed=True, interleaved=True)


def _with_rope_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with transformers' GPT-OSS rope defaults filled in: YaRN (``DEFAULT_ROPE``)
    when neither ``rope_parameters`` nor ``rope_scaling`` is given, and theta 150000 when
    no rope_theta is."""
    cfg = dict(cfg)
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, dict) else None
    if params is None and cfg.get("rope_scaling") is None:
        cfg["rope_parameters"] = params = dict(DEFAULT_ROPE)
    if cfg.get("rope_theta") is None and (params is None or params.get("rope_theta") is None):
        cfg["rope_theta"] = DEFAULT_ROPE_THETA
    return cfg


@dataclass(frozen=True)
class GptOssConfig(TextModelConfig):
    intermediate_size: int  # each expert's
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float  # the sigmoid's gain in the experts' clamped SwiGLU
    swiglu_limit: float  # gate clamped above, up to +-limit, before it
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # biases on q, k, v and o

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GptOssConfig:
        r = ConfigReader(_with_rope_defaults(cfg), architecture)
        r.refuse("partial_rotary_factor", unless=1.0, why="GPT-OSS rotates whole heads")
        layers = r.need("num_hidden_layers")
        kinds = layer_types(r, layers, ["sliding_attention" if i % 2 == 0 else
                                        "full_attention" for i in range(layers)])
        window = r.get("sliding_window", DEFAULT_WINDOW, int)
        if ("sliding_window" in cfg and cfg["sliding_window"] is None
                and "sliding_attention" in kinds):
            raise ConfigError(f"{architecture} config 'sliding_window' is null but "
                              "'layer_types' has sliding_attention layers; give the window "
                              "(128 in the released models)")
        if window < 1:
            raise ConfigError(f"{architecture} config 'sliding_window'={window} must be "
                              "positive")
        theta, scaling = rope_settings(r)
        fields = decoder_fields(r, architecture, windows_of(kinds, window),
                                head_dim=r.get("head_dim", 64, int))
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 131072, int)
        limit = r.get("swiglu_limit", 7.0, float)
        if not limit > 0:
            raise ConfigError(f"{architecture} config 'swiglu_limit'={limit} must be positive")
        return cls(**fields,
                   intermediate_size=r.get("intermediate_size", 2880, int),
                   num_local_experts=r.first(("num_local_experts", "num_experts"), 128),
                   num_experts_per_tok=r.get("num_experts_per_tok", 4, int),
                   swiglu_alpha=r.get("swiglu_alpha", 1.702, float),
                   swiglu_limit=limit,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", True, bool))


class GptOssMLP(nn.Module):
    """The MoE MLP: ``router`` (Linear [E, H] with a bias) scores the experts,
    ``select_experts`` (top-k then softmax) picks them, ``experts`` (``FusedMoE``) run
    them."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must lie in 1..{experts}")
        self.top_k = top_k
        self.router = mark_router(Linear(config.hidden_size, experts, bias=True))
        self.experts = FusedMoE(experts, config.hidden_size, config.intermediate_size,
                                layout=EXPERT_LAYOUT, bias=True, activation="swigluoai",
                                swiglu_alpha=config.swiglu_alpha,
                                swiglu_limit=config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, True, "topk_softmax")  # [num_tokens, top_k] each
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, sliding_window=config.layer_windows[layer_idx],
            sinks=True)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GptOssModel(nn.Module):
    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GptOssModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names: fused expert tensors
        ``mlp.experts.gate_up_proj`` ...); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        # MXFP4 experts (``*_blocks`` / ``*_scales``) come back as their dense [E, in, out]
        dtype = self.model.layers[0].mlp.experts.w13.dtype
        weights = dequantize_pairs(weights, dtype, transpose=True)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded
