"""EXAONE 4.0, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step.

Against Llama: the norms come after the sublayers (``post_attention_layernorm`` on the
attention output and ``post_feedforward_layernorm`` on the MLP output, each before its
residual add; nothing normalises the sublayers' inputs); q and k get an RMSNorm per head
before rotary; layers are sliding-window or global by ``layer_types``, and when the config
has a sliding window the global layers use no positional encoding at all (NoPE), only
the sliding ones rotate.
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
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


def _layer_kinds(r: ConfigReader, layers: int, window: int | None) -> list[str]:
    """``layer_types``, else transformers' default from ``sliding_window_pattern`` (an
    integer n: every n-th layer global, the rest sliding; all global without a window)."""
    if r.cfg.get("layer_types") is not None:
        return layer_types(r, layers)
    if window is None:
        return ["full_attention"] * layers
    pattern = r.cfg.get("sliding_window_pattern", 4)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise ConfigError(f"{r.architecture} config 'sliding_window_pattern'={pattern!r} is "
                          "not supported without 'layer_types' (a positive integer is)")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(layers)]


@dataclass(frozen=True)
class Exaone4Config(TextModelConfig):
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # the MLP gate's activation
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    layer_rotary: tuple[bool, ...]  # whether each layer rotates q and k (False: NoPE)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Exaone4Config:
        r = ConfigReader(cfg, architecture)
        try:
            act = check_activation(r.get("hidden_act", "silu", str), "hidden_act", gated=True)
        except UnsupportedActivationError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        layers = r.need("num_hidden_layers")
        # transformers' default window (4096) when the key is absent; null: none
        window = r.get("sliding_window", None, int) if "sliding_window" in cfg else 4096
        kinds = _layer_kinds(r, layers, window)
        if window is None and "sliding_attention" in kinds:
            raise ConfigError(f"{architecture} config 'sliding_window' is null but "
                              "'layer_types' has sliding_attention layers; give a window")
        theta, scaling = rope_settings(r)
        fields = decoder_fields(r, architecture, windows_of(kinds, window))
        fields["num_key_value_heads"] = r.get("num_key_value_heads", 32, int)
        return cls(**fields, intermediate_size=r.need("intermediate_size"),
                   rms_norm_eps=r.get("rms_norm_eps", 1e-5, float), hidden_act=act,
                   rope_theta=theta, rope_scaling=scaling,
                   layer_rotary=tuple(window is None or k == "sliding_attention"
                                      for k in kinds))


class Exaone4DecoderLayer(nn.Module):
    def __init__(self, config: Exaone4Config, layer_idx: int) -> None:
        super().__init__()
        rotary = (RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                  config.rope_theta, config.rope_scaling)
                  if config.layer_rotary[layer_idx] else None)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qk_norm=partial(RMSNorm, eps=config.rms_norm_eps),
            sliding_window=config.layer_windows[layer_idx])
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


class Exaone4Model(nn.Module):
    def __init__(self, config: Exaone4Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Exaone4DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


class Exaone4ForCausalLM(nn.Module):
    def __init__(self, config: Exaone4Config) -> None:
        super().__init__()
        self.config = config
        self.model = Exaone4Model(config)
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
