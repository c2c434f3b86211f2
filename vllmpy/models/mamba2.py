"""Mamba2: a stack of Mamba2 mixers (``vllmpy.layers.mamba2``), each behind an RMSNorm
with a residual around it; no attention and no positions. Read top to bottom like the
Hugging Face modeling file, over the flattened tokens of one step.

Every layer keeps a recurrent state per sequence (a seat), nothing per token: the config's
``layer_cache_specs`` lists one Mamba2 state per layer and no paged K/V. The attention
fields every config carries (``num_attention_heads``, ``num_key_value_heads``,
``head_dim``) describe no layer here and are 1.

transformers keeps the residual stream in float32 (``residual_in_fp32``); here it stays in
the model's dtype (the same values in float32, a rounding apart in 16-bit dtypes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.core.cache_spec import CacheSpec
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer, mamba2_state_spec
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.config_reader import ConfigReader, float_list
from vllmpy.models.weights import load_packed_weights

# serving length when the config names none: Mamba2 has no position limit
DEFAULT_MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Mamba2Config(TextModelConfig):
    mamba_num_heads: int  # the config's num_heads
    mamba_head_dim: int  # the config's head_dim
    state_size: int
    n_groups: int
    conv_kernel: int
    use_bias: bool  # in_proj and out_proj biases
    use_conv_bias: bool
    layer_norm_epsilon: float
    time_step_limit: tuple[float, float]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Mamba2Config:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu", "swish"), "silu")
        # transformers' Mamba2 always gates before its group norm; the original
        # implementation's other choices would run differently there
        r.refuse("norm_before_gate", unless=False, why="Mamba2 gates before the norm")
        r.refuse("rms_norm", unless=True, why="Mamba2 has the gated RMSNorm")
        hidden = r.need("hidden_size")
        layers = r.need("num_hidden_layers")
        heads = r.get("num_heads", 128, int)
        head_dim = r.get("head_dim", 64, int)
        expand = r.get("expand", 2, int)
        if hidden * expand != heads * head_dim:
            raise ConfigError(f"{architecture} config: hidden_size * expand ({hidden * expand}) "
                              f"must equal num_heads * head_dim ({heads * head_dim})")
        groups = r.get("n_groups", 8, int)
        if groups < 1 or heads % groups:
            raise ConfigError(f"{architecture} config 'n_groups'={groups} must divide "
                              f"num_heads ({heads})")
        kernel = r.get("conv_kernel", 4, int)
        if kernel < 2:
            raise ConfigError(f"{architecture} config 'conv_kernel'={kernel} is not "
                              "supported (at least 2)")
        limit = float_list(r, "time_step_limit", (0.0, float("inf")), 2)
        return cls(architectures=[architecture], model_type=str(r.get("model_type", "")),
                   hidden_size=hidden, num_hidden_layers=layers,
                   num_attention_heads=1, num_key_value_heads=1, head_dim=1,
                   max_position_embeddings=r.get("max_position_embeddings",
                                                 DEFAULT_MAX_POSITIONS, int),
                   vocab_size=r.need("vocab_size"),
                   tie_word_embeddings=r.get("tie_word_embeddings", False, bool),
                   layer_windows=(None,) * layers,
                   mamba_num_heads=heads, mamba_head_dim=head_dim,
                   state_size=r.get("state_size", 128, int), n_groups=groups,
                   conv_kernel=kernel, use_bias=r.get("use_bias", False, bool),
                   use_conv_bias=r.get("use_conv_bias", True, bool),
                   layer_norm_epsilon=r.get("layer_norm_epsilon", 1e-5, float),
                   time_step_limit=(limit[0], limit[1]))

    def layer_cache_specs(self) -> tuple[CacheSpec, ...]:
        """One Mamba2 state per layer."""
        spec = mamba2_state_spec(self.mamba_num_heads, self.mamba_head_dim, self.state_size,
                                 self.n_groups, self.conv_kernel)
        return (spec,) * self.num_hidden_layers


class Mamba2Block(nn.Module):
    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = Mamba2Mixer(
            config.hidden_size, config.mamba_num_heads, config.mamba_head_dim,
            config.state_size, config.n_groups, config.conv_kernel,
            eps=config.layer_norm_epsilon, proj_bias=config.use_bias,
            conv_bias=config.use_conv_bias, time_step_limit=config.time_step_limit)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.norm(hidden_states)
        else:
            hidden_states, residual = self.norm(hidden_states, residual)
        return self.mixer(hidden_states, attn_metadata), residual


class Mamba2Model(nn.Module):
    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Mamba2Block(config)
                                     for _ in range(config.num_hidden_layers)])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, attn_metadata: AttentionMetadata
                ) -> torch.Tensor:
        hidden_states = self.embeddings(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm_f(hidden_states, residual)
        return hidden_states


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Older checkpoints spell the embedding ``backbone.embedding``."""
    for name, tensor in weights:
        if name.startswith("backbone.embedding."):
            name = "backbone.embeddings." + name[len("backbone.embedding."):]
        yield name, tensor


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.config = config
        self.backbone = Mamba2Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.backbone(input_ids, attn_metadata)  # no positions: the state orders

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.backbone.embeddings, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        return load_packed_weights(self, _renamed(weights), {}, skip)
