"""OPT, read top to bottom like the Hugging Face modeling file, over the flattened tokens
of one engine step: learned positions stored with an offset of 2, LayerNorm before each
block (or after it: ``do_layer_norm_before=False``, OPT-350m), a ReLU MLP, and token
embeddings of ``word_embed_proj_dim`` projected in and out of the hidden width when the
two differ (OPT-350m again).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import Activation, check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.config_reader import ConfigReader, decoder_fields
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights

# OPTLearnedPositionalEmbedding's rows start at this offset
POSITION_OFFSET = 2


@dataclass(frozen=True)
class OPTConfig(TextModelConfig):
    ffn_dim: int
    activation_function: str
    do_layer_norm_before: bool  # pre-LN blocks (False: each block's output is normalized)
    remove_final_layer_norm: bool  # the config's _remove_final_layer_norm
    word_embed_proj_dim: int  # the embeddings' width (project_in/out when != hidden_size)
    enable_bias: bool  # the attention and MLP projections carry biases
    layer_norm_elementwise_affine: bool  # the LayerNorms have a weight and a bias

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> OPTConfig:
        r = ConfigReader(cfg, architecture)
        act = r.get("activation_function", "relu", str)
        try:
            check_activation(act, "activation_function", gated=False)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        fields = decoder_fields(r, architecture)
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        if hidden % heads:
            raise ConfigError(f"{architecture} config: hidden_size ({hidden}) must be a "
                              f"multiple of num_attention_heads ({heads})")
        # OPT has one K/V head per query head of hidden_size // heads dims, whatever else
        # the config says
        fields.update(num_key_value_heads=heads, head_dim=hidden // heads,
                      tie_word_embeddings=r.get("tie_word_embeddings", True, bool))
        return cls(**fields, ffn_dim=r.need("ffn_dim"), activation_function=act,
                   do_layer_norm_before=r.get("do_layer_norm_before", True, bool),
                   remove_final_layer_norm=r.get("_remove_final_layer_norm", False, bool),
                   word_embed_proj_dim=r.get("word_embed_proj_dim", hidden, int),
                   enable_bias=r.get("enable_bias", True, bool),
                   layer_norm_elementwise_affine=r.get("layer_norm_elementwise_affine", True,
                                                       bool))


def _layer_norm(config: OPTConfig) -> nn.Module:
    if config.layer_norm_elementwise_affine:
        return LayerNorm(config.hidden_size, 1e-5)
    return nn.LayerNorm(config.hidden_size, elementwise_affine=False)  # no parameters


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.enable_bias
        self.self_attn = SelfAttention(hidden, config.num_attention_heads,
                                       config.num_attention_heads, config.head_dim,
                                       rotary=None, qkv_bias=bias, o_bias=bias)
        self.do_layer_norm_before = config.do_layer_norm_before
        self.activation_fn = Activation(config.activation_function)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = Linear(hidden, config.ffn_dim, bias=bias)
        self.fc2 = Linear(config.ffn_dim, hidden, bias=bias)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(positions, hidden_states, attn_metadata)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)

        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(config.vocab_size, proj)
        self.embed_positions = VocabEmbedding(config.max_position_embeddings + POSITION_OFFSET,
                                              hidden)
        self.project_out = Linear(hidden, proj) if proj != hidden else None
        self.project_in = Linear(proj, hidden) if proj != hidden else None
        self.final_layer_norm = (_layer_norm(config) if config.do_layer_norm_before
                                 and not config.remove_final_layer_norm else None)
        self.layers = nn.ModuleList(
            [OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden_states = inputs_embeds + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states  # [num_tokens, word_embed_proj_dim]


class OPTModel(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, attn_metadata)


def _hf_to_model(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``model.`` prefix that some checkpoints lack; out_proj is the block's o_proj."""
    for name, tensor in weights:
        if name.startswith("decoder."):
            name = f"model.{name}"
        yield name.replace("self_attn.out_proj.", "self_attn.o_proj."), tensor


class OPTForCausalLM(nn.Module):
    def __init__(self, config: OPTConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.word_embed_proj_dim, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.decoder.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(_hf_to_model(weights)),
                                   PACKED_QKV_GATE_UP, skip) | scales.loaded
