"""Cohere (Command-R, Aya-23) and Cohere2 (Command-R7B, Command-A), read top to bottom like
the Hugging Face modeling files, over the flattened tokens of one engine step.

Both run attention and a gated SiLU MLP side by side on the output of one LayerNorm
without bias, computed in float32 (``CohereLayerNorm``), rotate neighbouring pairs of dims
(interleaved rotary) and multiply the logits by ``logit_scale``. Cohere may put a
per-head LayerNorm on q and k (``use_qk_norm``). Cohere2 gives its sliding layers a
window (``layer_types``, or every layer but each ``sliding_window_pattern``-th) and rotates
only those: the full-attention layers have no position encoding (NoPE).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class CohereConfig(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    logit_scale: float  # the logits are multiplied by it
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool  # q, k, v and o carry biases
    use_qk_norm: bool  # a LayerNorm on each head of q and k, weights per head (Cohere)
    # per layer: whether it rotates q and k (Cohere: all; Cohere2: its sliding layers)
    layer_rotary: tuple[bool, ...]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> CohereConfig:
        r = ConfigReader(cfg, architecture)
        act = r.get("hidden_act", "silu", str)
        try:
            check_activation(act, "hidden_act", gated=True)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        r.refuse("partial_rotary_factor", unless=1.0, why=f"{architecture} rotates whole heads")
        layers = r.need("num_hidden_layers")
        if architecture == "Cohere2ForCausalLM":
            r.refuse("use_qk_norm", unless=False, why="Cohere2 has no q/k norms")
            # transformers' default when the key is absent; null: no layer slides
            window = r.get("sliding_window", None, int) if "sliding_window" in cfg else 4096
            pattern = r.get("sliding_window_pattern", 4, int)
            if pattern <= 0:
                raise ConfigError(f"{architecture} config 'sliding_window_pattern' must be "
                                  f"positive, got {pattern}")
            kinds = layer_types(r, layers, ["sliding_attention" if (i + 1) % pattern
                                            else "full_attention" for i in range(layers)])
            windows = windows_of(kinds, window)
            # Cohere2Attention rotates exactly the layers that have a window
            rotary = tuple(w is not None for w in windows)
            qk_norm = False
        else:
            windows, rotary = (None,) * layers, (True,) * layers
            qk_norm = r.get("use_qk_norm", False, bool)
        theta, scaling = rope_settings(r)
        params = cfg.get("rope_parameters")
        if (architecture == "CohereForCausalLM" and cfg.get("rope_theta") is None
                and not (isinstance(params, dict) and "rope_theta" in params)):
            theta = 500000.0  # transformers' CohereConfig default
        fields = decoder_fields(r, architecture, windows)
        if architecture == "Cohere2ForCausalLM":  # Cohere2Config sets it so, always
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        # transformers' defaults for the family where they differ from Llama's
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 8192, int)
        fields["tie_word_embeddings"] = r.get("tie_word_embeddings", True, bool)
        return cls(**fields, intermediate_size=r.need("intermediate_size"), hidden_act=act,
                   layer_norm_eps=r.get("layer_norm_eps", 1e-5, float),
                   logit_scale=r.get("logit_scale", 0.0625, float),
                   rope_theta=theta, rope_scaling=scaling,
                   attention_bias=r.get("attention_bias", False, bool),
                   use_qk_norm=qk_norm, layer_rotary=rotary)


class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm: no bias, mean and variance over the last of ``shape`` (the
    hidden size, or (num_heads, head_dim) for the q/k norms: one weight row per head), all
    in float32, rounded once to the input's dtype. Takes [num_tokens, prod(shape)]."""

    def __init__(self, shape: tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.weight.shape
        y = x.float().view(x.shape[0], *shape)  # [num_tokens, *shape]
        y = F.layer_norm(y, (shape[-1],), None, None, self.eps) * self.weight.float()
        return y.view(x.shape).to(x.dtype)


class CohereDecoderLayer(nn.Module):
    def __init__(self, config: CohereConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps, head_dim = config.hidden_size, config.layer_norm_eps, config.head_dim
        rotary = (RotaryEmbedding(head_dim, config.max_position_embeddings, config.rope_theta,
                                  config.rope_scaling, is_neox_style=False)
                  if config.layer_rotary[layer_idx] else None)

        def qk_norm(width: int) -> nn.Module:
            return CohereLayerNorm((width // head_dim, head_dim), eps)

        self.self_attn = SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            rotary=rotary, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
            qk_norm=qk_norm if config.use_qk_norm else None, qk_norm_per_head=False,
            sliding_window=config.layer_windows[layer_idx])
        self.mlp = GatedMLP(hidden, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = CohereLayerNorm((hidden,), eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states_attention = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states_mlp = self.mlp(hidden_states)
        return residual + hidden_states_attention + hidden_states_mlp


class CohereModel(nn.Module):
    def __init__(self, config: CohereConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [CohereDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = CohereLayerNorm((config.hidden_size,), config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


class CohereForCausalLM(nn.Module):
    """Both Cohere and Cohere2 (their configs say which layers slide and rotate)."""

    def __init__(self, config: CohereConfig) -> None:
        super().__init__()
        self.config = config
        self.model = CohereModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out,
                           scale=self.config.logit_scale)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


def _gguf_config(f: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """What the tensors tell (biases, q/k norms) and the logit scale. llama.cpp's cohere2
    converter writes the window but not the pattern: llama.cpp slides three layers of
    every four (the last of each four is global), unless the file lists them."""
    names = f.tensor_names
    config: dict[str, Any] = {"logit_scale": f.metadata(f"{f.architecture}.logit_scale"),
                              "attention_bias": "blk.0.attn_q.bias" in names}
    if f.architecture == "command-r":
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
        return config
    pattern = f.metadata(f"{f.architecture}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        config["layer_types"] = ["sliding_attention" if s else "full_attention"
                                 for s in pattern]
    else:
        config["sliding_window_pattern"] = 4
    return config


# llama.cpp's "command-r" (Cohere) and "cohere2": the common names, one norm per layer,
# a tied head
GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"attn_norm": "input_layernorm",
                                  "attn_q_norm": "self_attn.q_norm",
                                  "attn_k_norm": "self_attn.k_norm"})
