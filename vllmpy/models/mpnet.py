"""MPNet (all-mpnet-base-v2 and kin): an encoder-only model for the pooling runner, read
top to bottom like the Hugging Face modeling file, over the packed whole prompts of one
step.

Word and position embeddings (positions numbered from padding_idx + 1, RoBERTa's way; no
token types) are summed and LayerNormed; each post-LN layer is like BERT's, with the
attention's projections named ``attention.attn.q/k/v/o`` and one relative-position bias
shared by every layer: ``encoder.relative_attention_bias`` [num_buckets, heads] indexed by
T5-style bidirectional buckets of key position - query position (exact below 8 either way,
log-spaced up to 128), built once per step in the padded layout of ``encoder_attention``.

``MPNetModel`` also serves ``MPNetForMaskedLM`` checkpoints (all-mpnet-base-v2 is one by
its config, with the bare model's weights): the masked-LM head and the pooler are skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.encoder_attention import encoder_attention, padded_layout
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.bert import BertDenseResidualNorm, BertIntermediate, encoder_shape
from vllmpy.models.config_reader import ConfigReader
from vllmpy.models.weights import load_packed_weights

# Hugging Face's MPNetEmbeddings fixes padding_idx at 1 whatever pad_token_id says
PADDING_IDX = 1
MAX_DISTANCE = 128  # relative distances from here on share the last bucket


@dataclass(frozen=True)
class MPNetConfig(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    relative_attention_num_buckets: int
    position_table_size: int  # rows of position_embeddings (config max_position_embeddings)

    ENCODER_ONLY = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> MPNetConfig:
        r = ConfigReader(cfg, architecture)
        act, hidden, heads, layers = encoder_shape(r, architecture)
        table = r.get("max_position_embeddings", 514, int)
        if table <= PADDING_IDX + 1:
            raise ConfigError(f"{architecture} config: max_position_embeddings ({table}) "
                              f"leaves no position past padding_idx + 1")
        buckets = r.get("relative_attention_num_buckets", 32, int)
        if buckets < 4 or buckets % 4:
            raise ConfigError(f"{architecture} config: relative_attention_num_buckets "
                              f"({buckets}) must be a positive multiple of 4")
        return cls(
            architectures=[architecture], model_type=str(r.get("model_type", "mpnet")),
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=hidden // heads,
            max_position_embeddings=table - PADDING_IDX - 1,
            vocab_size=r.need("vocab_size"), tie_word_embeddings=False,
            layer_windows=(None,) * layers,
            intermediate_size=r.need("intermediate_size"), hidden_act=act,
            layer_norm_eps=r.get("layer_norm_eps", 1e-12, float),
            relative_attention_num_buckets=buckets, position_table_size=table)


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int,
                             max_distance: int = MAX_DISTANCE) -> torch.Tensor:
    """Bucket of each (key - query) distance, as Hugging Face's MPNetEncoder buckets it:
    half the buckets for keys before the query, half for keys at or after it; within a
    half, distances below a quarter of the buckets are exact and the rest log-spaced up to
    ``max_distance``, past which they share the last bucket."""
    half = num_buckets // 2
    distance = -relative_position  # > 0: the key comes before the query
    bucket = (distance < 0).to(torch.int64) * half
    distance = distance.abs()
    exact = half // 2
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (half - exact)).to(torch.int64)).clamp(max=half - 1)
    return bucket + torch.where(distance < exact, distance, far)


class MPNetEmbeddings(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = VocabEmbedding(config.position_table_size,
                                                  config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + PADDING_IDX + 1)  # [num_tokens, hidden_size]
        return self.LayerNorm(x)


class MPNetSelfAttention(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = PackedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden},
                                     bias=True)
        self.o = Linear(hidden, hidden, bias=True)

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # [num_tokens, 3, num_heads, head_dim] -> q, k, v [num_tokens, num_heads, head_dim]
        q, k, v = self.qkv_proj(hidden_states).view(
            -1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.o(encoder_attention(q, k, v, attn_metadata, bias=position_bias))


class MPNetAttention(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.attn = MPNetSelfAttention(config)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        out = self.attn(hidden_states, position_bias, attn_metadata)
        return self.LayerNorm(out + hidden_states)


class MPNetLayer(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.attention = MPNetAttention(config)
        # the feed-forward half is BERT's, with the same parameter names
        self.intermediate = BertIntermediate(config)  # type: ignore[arg-type]
        self.output = BertDenseResidualNorm(config, config.intermediate_size)  # type: ignore[arg-type]

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.attention(hidden_states, position_bias, attn_metadata)
        return self.output(self.intermediate(hidden_states), hidden_states)


class MPNetEncoder(nn.Module):
    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.num_buckets = config.relative_attention_num_buckets
        self.layer = nn.ModuleList([MPNetLayer(config)
                                    for _ in range(config.num_hidden_layers)])
        self.relative_attention_bias = VocabEmbedding(self.num_buckets,
                                                      config.num_attention_heads)

    def position_bias(self, attn_metadata: AttentionMetadata,
                      device: torch.device) -> torch.Tensor:
        """[num_seqs, num_heads, longest, longest]: the bias of key j for query i, which
        depends on j - i only (every sequence starts at position 0)."""
        layout = padded_layout(attn_metadata, device)
        pos = torch.arange(layout.longest, device=device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.num_buckets)
        values = self.relative_attention_bias(buckets)  # [longest, longest, num_heads]
        return values.permute(2, 0, 1).unsqueeze(0).expand(layout.num_seqs, -1, -1, -1)

    def forward(self, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        position_bias = self.position_bias(attn_metadata, hidden_states.device)
        for layer in self.layer:
            hidden_states = layer(hidden_states, position_bias, attn_metadata)
        return hidden_states


# checkpoint q/k/v -> the packed qkv_proj of MPNetSelfAttention
_PACKED_QKV: dict[str, tuple[str, str | int]] = {
    "q": ("qkv_proj", "q"), "k": ("qkv_proj", "k"), "v": ("qkv_proj", "v")}


def _bare(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The encoder's tensors under its own names: an ``mpnet.`` prefix dropped; the
    position-ids buffer, the pooler and the masked-LM head left out."""
    for name, tensor in weights:
        name = name.removeprefix("mpnet.")
        if not name.endswith("embeddings.position_ids") and not name.startswith(
                ("pooler.", "lm_head.")):
            yield name, tensor


class MPNetModel(nn.Module):
    """The bare encoder: forward gives the last layer's states, [num_tokens, hidden_size]."""

    default_pooling_type = "CLS"  # vLLM's default for its BERT-like embedding models

    def __init__(self, config: MPNetConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = MPNetEmbeddings(config)
        self.encoder = MPNetEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions), attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        return load_packed_weights(self, _bare(weights), _PACKED_QKV)
