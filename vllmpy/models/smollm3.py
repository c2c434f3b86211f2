"""SmolLM3, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step.

Against Llama: some layers use no positional encoding (NoPE): ``no_rope_layers`` holds
one flag per layer (1: rotary, 0: none), by default every ``no_rope_layer_interval``-th
layer (the 4th, 8th, ...) without; with ``use_sliding_window`` the layers ``layer_types``
names slide over ``sliding_window`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import UnsupportedActivationError, check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

DEFAULT_THETA = 2000000.0  # transformers' SmolLM3Config.default_theta


def _rotary_layers(r: ConfigReader, layers: int) -> tuple[bool, ...]:
    """Whether each layer rotates: ``no_rope_layers`` (1 or 0 per layer), else every
    ``no_rope_layer_interval``-th layer without (transformers' default)."""
    flags = r.cfg.get("no_rope_layers")
    if flags is None:
        interval = r.get("no_rope_layer_interval", 4, int)
        if interval <= 0:
            raise ConfigError(f"{r.architecture} config 'no_rope_layer_interval'={interval} "
                              "must be positive")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(flags, list) or len(flags) != layers or any(
            isinstance(f, bool) or f not in (0, 1) for f in flags):
        raise ConfigError(f"{r.architecture} config 'no_rope_layers' must list 1 (rotary) or "
                          f"0 (no positional encoding) for each of the {layers} layers, "
                          f"got {flags!r}")
    return tuple(f == 1 for f in flags)


@dataclass(frozen=True)
class SmolLM3Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # the MLP gate's activation
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o carry biases
    mlp_bias: bool
    layer_rotary: tuple[bool, ...]  # whether each layer rotates q and k (False: NoPE)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> SmolLM3Config:
        r = ConfigReader(cfg, architecture)
        try:
            act = check_activation(r.get("hidden_act", "silu", str), "hidden_act", gated=True)
        except UnsupportedActivationError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        layers = r.need("num_hidden_layers")
        rotary = _rotary_layers(r, layers)
        sliding = r.get("use_sliding_window", False, bool)
        window = r.get("sliding_window", None, int) if sliding else None
        # transformers' default: the NoPE layers slide, when windows are on
        kinds = layer_types(r, layers, ["sliding_attention" if window and not rope
                                        else "full_attention" for rope in rotary])
        if "sliding_attention" in kinds and window is None:
            raise ConfigError(f"{architecture} config 'layer_types' has sliding_attention "
                              f"layers but use_sliding_window={sliding!r} and sliding_window="
                              f"{cfg.get('sliding_window')!r}; transformers' attention "
                              "implementations disagree on such a config")
        theta, scaling = rope_settings(r)
        params = cfg.get("rope_parameters")
        if cfg.get("rope_theta") is None and not (isinstance(params, dict)
                                                  and "rope_theta" in params):
            theta = DEFAULT_THETA
        fields = decoder_fields(r, architecture, windows_of(kinds, window))
        # transformers' SmolLM3Config defaults where they differ from Llama's
        fields["tie_word_embeddings"] = r.get("tie_word_embeddings", True, bool)
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 32768, int)
        return cls(**fields, intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float), hidden_act=act,
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   mlp_bias=r.get("mlp_bias", False, bool), layer_rotary=rotary)


class SmolLM3DecoderLayer(nn.Module):
    def __init__(self, config: SmolLM3Config, layer_idx: int) -> None:
        super().__init__()
        rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                  config.rope_theta, config.rope_scaling)
                  if config.layer_rotary[layer_idx] else None)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, sliding_window=config.layer_windows[layer_idx])
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act,
                            bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        gate_up, residual = rms_norm_linear(self.post_attention_layernorm,
                                            self.mlp.gate_up_proj, hidden_states, residual)
        return self.mlp.down(gate_up), residual


class SmolLM3Model(nn.Module):
    def __init__(self, config: SmolLM3Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [SmolLM3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class SmolLM3ForCausalLM(nn.Module):
    def __init__(self, config: SmolLM3Config) -> None:
        super().__init__()
        self.config = config
        self.model = SmolLM3Model(config)
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
