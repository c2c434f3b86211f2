"""Starcoder2, read top to bottom like the Hugging Face modeling file, over the flattened
tokens of one engine step: the Llama layout of grouped-query attention with rotary, but
LayerNorms with biases (``norm_epsilon``), a plain ``gelu_pytorch_tanh`` MLP ``c_fc`` /
``c_proj``, biases on every projection (``use_bias``) and one sliding window for every
layer (``sliding_window``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, tie_quantized_lm_head
from vllmpy.layers.mlp import PlainMLP
from vllmpy.layers.norm import LayerNorm
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
class Starcoder2Config(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    norm_epsilon: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    use_bias: bool  # every projection carries a bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Starcoder2Config:
        r = ConfigReader(cfg, architecture)
        act = r.get("hidden_act", "gelu_pytorch_tanh", str)
        try:
            check_activation(act, "hidden_act", gated=False)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        r.refuse("partial_rotary_factor", unless=1.0, why="Starcoder2 rotates whole heads")
        layers = r.need("num_hidden_layers")
        window = r.get("sliding_window", None, int)  # null: every layer sees every token
        kinds = layer_types(r, layers, ["sliding_attention" if window else "full_attention"]
                            * layers)
        theta, scaling = rope_settings(r)
        fields = decoder_fields(r, architecture, windows_of(kinds, window))
        # transformers' Starcoder2Config defaults where they differ from Llama's
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 4096, int)
        fields["num_key_value_heads"] = r.get("num_key_value_heads", 2, int)
        fields["tie_word_embeddings"] = r.get("tie_word_embeddings", True, bool)
        return cls(**fields, intermediate_size=r.need("intermediate_size"), hidden_act=act,
                   norm_epsilon=r.get("norm_epsilon", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   use_bias=r.get("use_bias", True, bool))


class Starcoder2DecoderLayer(nn.Module):
    def __init__(self, config: Starcoder2Config, layer_idx: int) -> None:
        super().__init__()
        hidden, eps, bias = config.hidden_size, config.norm_epsilon, config.use_bias
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            rotary=rotary, qkv_bias=bias, o_bias=bias,
            sliding_window=config.layer_windows[layer_idx])
        self.mlp = PlainMLP(hidden, config.intermediate_size, config.hidden_act, bias=bias,
                            names=("c_fc", "c_proj"))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Starcoder2Model(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Starcoder2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LayerNorm(config.hidden_size, config.norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Starcoder2ForCausalLM(nn.Module):
    def __init__(self, config: Starcoder2Config) -> None:
        super().__init__()
        self.config = config
        self.model = Starcoder2Model(config)
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
            weights = tie_quantized_lm_head(self, weights)  # a 4-bit copy, if it pays
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


def _gguf_config(f: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's converter writes no bias flag (the tensors tell) and no sliding window
    (llama.cpp runs starcoder2 with full attention; a file that names a window gets it)."""
    return {"use_bias": "blk.0.attn_q.bias" in f.tensor_names,
            "norm_epsilon": common.get("layer_norm_eps", 1e-5),
            "hidden_act": "gelu_pytorch_tanh"}


# llama.cpp's "starcoder2": the common names, with biases; the MLP is c_fc / c_proj
GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                     global_names={"output_norm.bias": "model.norm.bias"})
