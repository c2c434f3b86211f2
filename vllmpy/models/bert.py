"""BERT, RoBERTa and XLM-RoBERTa: encoder-only models for the pooling runner, read top to
bottom like the Hugging Face modeling file, over the packed whole prompts of one step.

Word, position and token-type embeddings are summed and LayerNormed; each post-LN layer is
bidirectional self-attention (q/k/v with biases, loaded into one ``qkv_proj``) then an
output dense with the residual and a LayerNorm, an intermediate dense with ``hidden_act``,
and an output dense with the residual and a LayerNorm. There is no KV cache: attention is
``encoder_attention`` over each sequence's own tokens.

The engine hands no token type ids, so the model derives them as a BERT tokenizer's pair
encoding ``[CLS] a [SEP] b [SEP]`` sets them: 0 up to and including a sequence's first
``[SEP]`` (``sep_token_id``), 1 after it; a single text is all 0. RoBERTa and XLM-R
(whose tokenizers give pairs no token types) are all 0, and number their positions from ``pad_token_id + 1``
(Hugging Face's ``create_position_ids_from_input_ids`` on unpadded input).

Classes: ``BertModel`` (the bare encoder; also serves ``BertForMaskedLM``, ``RobertaModel``
and ``XLMRobertaModel`` checkpoints, whose heads and poolers are skipped),
``BertForSequenceClassification`` (the BERT pooler, dense + tanh on the CLS state, then
``classifier``) and ``RobertaForSequenceClassification`` (also XLM-R: the head's dense +
tanh + ``out_proj`` on the CLS state).
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
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.encoder_attention import encoder_attention
from vllmpy.layers.linear import Linear, PackedLinear
from vllmpy.layers.norm import LayerNorm
from vllmpy.models.config_reader import ConfigReader
from vllmpy.models.weights import load_packed_weights

# architectures that number positions from padding_idx + 1 (Hugging Face's Roberta*)
_ROBERTA_STYLE = frozenset({"RobertaModel", "XLMRobertaModel",
                            "RobertaForSequenceClassification",
                            "XLMRobertaForSequenceClassification"})
# the id a BERT WordPiece vocabulary gives [SEP] (bert-base-uncased, MiniLM, ms-marco
# cross-encoders): config.json rarely says it
BERT_SEP_TOKEN_ID = 102


def encoder_shape(r: ConfigReader, architecture: str) -> tuple[str, int, int, int]:
    """A BERT-like config's activation, hidden size, heads and layers, checked."""
    act = r.get("hidden_act", "gelu", str)
    try:
        check_activation(act, "hidden_act", gated=False)
    except ValueError as e:
        raise ConfigError(f"{architecture} config: {e}") from None
    hidden, heads = r.need("hidden_size"), r.need("num_attention_heads")
    layers = r.need("num_hidden_layers")
    if hidden <= 0 or heads <= 0 or layers <= 0 or hidden % heads:
        raise ConfigError(f"{architecture} config: hidden_size ({hidden}) must be a "
                          f"positive multiple of num_attention_heads ({heads}), and "
                          f"num_hidden_layers ({layers}) positive")
    return act, hidden, heads, layers


@dataclass(frozen=True)
class BertConfig(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    type_vocab_size: int
    position_table_size: int  # rows of position_embeddings (config max_position_embeddings)
    position_offset: int  # position p reads row p + offset (RoBERTa: padding_idx + 1)
    # token type 1 after each sequence's first sep_token_id (BERT's pairs); False: every
    # token is type 0 (RoBERTa and XLM-R, whose tokenizers give pairs no types)
    pair_token_types: bool
    sep_token_id: int  # ends segment A of a pair
    num_labels: int  # classification heads: logits per input
    id2label: dict[int, str]  # classification heads: each logit's label

    ENCODER_ONLY = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> BertConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("position_embedding_type", ("absolute",), "absolute")
        r.refuse("is_decoder", unless=False, why="an encoder-only model attends both ways")
        r.refuse("add_cross_attention", unless=False,
                 why="an encoder-only model has no encoder states to attend to")
        act, hidden, heads, layers = encoder_shape(r, architecture)
        table = r.need("max_position_embeddings")
        roberta = architecture in _ROBERTA_STYLE
        offset = r.get("pad_token_id", 1, int) + 1 if roberta else 0
        if table - offset <= 0:
            raise ConfigError(f"{architecture} config: max_position_embeddings ({table}) "
                              f"leaves no position past padding_idx + 1 ({offset})")
        types = r.get("type_vocab_size", 2, int)
        if types <= 0:
            raise ConfigError(f"{architecture} config: type_vocab_size must be positive, "
                              f"got {types}")
        id2label = {int(k): str(v) for k, v in r.get("id2label", {}, dict).items()}
        return cls(
            architectures=[architecture], model_type=str(r.get("model_type", "bert")),
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=hidden // heads,
            # the positions after the offset are the ones a prompt can use
            max_position_embeddings=table - offset,
            vocab_size=r.need("vocab_size"), tie_word_embeddings=False,
            layer_windows=(None,) * layers,
            intermediate_size=r.need("intermediate_size"), hidden_act=act,
            layer_norm_eps=r.get("layer_norm_eps", 1e-12, float),
            type_vocab_size=types,
            position_table_size=table, position_offset=offset,
            pair_token_types=types > 1 and not roberta,
            sep_token_id=r.get("sep_token_id", BERT_SEP_TOKEN_ID, int),
            num_labels=r.get("num_labels", len(id2label) or 2, int), id2label=id2label)


def pair_token_types(input_ids: torch.Tensor, positions: torch.Tensor,
                     sep_token_id: int) -> torch.Tensor:
    """[num_tokens] int64 token types of packed sequences: 0 up to and including each
    sequence's first ``sep_token_id``, 1 after it. ``positions`` run 0..len-1 within
    each sequence, so token t's sequence starts at row t - positions[t]."""
    sep = (input_ids == sep_token_id).to(torch.int32)
    before = torch.cumsum(sep, 0) - sep  # separators before each token, over the step
    start = torch.arange(input_ids.shape[0], device=input_ids.device) - positions
    return (before - before[start] > 0).to(torch.int64)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden)
        self.position_embeddings = VocabEmbedding(config.position_table_size, hidden)
        self.token_type_embeddings = VocabEmbedding(config.type_vocab_size, hidden)
        self.LayerNorm = LayerNorm(hidden, config.layer_norm_eps)
        self.position_offset = config.position_offset
        self.sep_token_id = config.sep_token_id
        self.pairs = config.pair_token_types

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(
            positions + self.position_offset)  # [num_tokens, hidden_size]
        if self.pairs:
            x = x + self.token_type_embeddings(
                pair_token_types(input_ids, positions, self.sep_token_id))
        else:
            x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = PackedLinear(hidden, {"q": hidden, "k": hidden, "v": hidden},
                                     bias=True)

    def forward(self, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # [num_tokens, 3, num_heads, head_dim] -> q, k, v [num_tokens, num_heads, head_dim]
        q, k, v = self.qkv_proj(hidden_states).view(
            -1, 3, self.num_heads, self.head_dim).unbind(1)
        return encoder_attention(q, k, v, attn_metadata)  # [num_tokens, hidden_size]


class BertDenseResidualNorm(nn.Module):
    """Hugging Face's BertSelfOutput / BertOutput: LayerNorm(dense(x) + residual)."""

    def __init__(self, config: BertConfig, input_size: int) -> None:
        super().__init__()
        self.dense = Linear(input_size, config.hidden_size, bias=True)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseResidualNorm(config, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden_states, attn_metadata), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = Activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseResidualNorm(config, config.intermediate_size)

    def forward(self, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.attention(hidden_states, attn_metadata)
        return self.output(self.intermediate(hidden_states), hidden_states)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, attn_metadata)
        return hidden_states


class BertPooler(nn.Module):
    """dense + tanh on a sequence's first ([CLS]) state, handed in already pooled."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_states))


# checkpoint q/k/v -> the packed qkv_proj of BertSelfAttention
_PACKED_QKV: dict[str, tuple[str, str | int]] = {
    "query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}
# index buffers some checkpoints saved beside the weights
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _without(weights: Iterable[tuple[str, torch.Tensor]], prefixes: tuple[str, ...]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint less its index buffers and the subtrees named by ``prefixes``."""
    for name, tensor in weights:
        if not name.endswith(_BUFFERS) and not name.startswith(prefixes):
            yield name, tensor


class BertModel(nn.Module):
    """The bare encoder: forward gives the last layer's states, [num_tokens, hidden_size]."""

    default_pooling_type = "CLS"  # vLLM's BertEmbeddingModel / RobertaEmbeddingModel

    def __init__(self, config: BertConfig, add_pooling_layer: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions), attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names, bare or under ``bert.`` /
        ``roberta.``); a pooler and a masked-LM head (``cls.``) are skipped, as
        sentence-transformers skips them. Returns the parameter names loaded."""
        def bare(stream: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                yield name.removeprefix("bert.").removeprefix("roberta."), tensor

        return load_packed_weights(self, _without(bare(weights), ("pooler.", "cls.")),
                                   _PACKED_QKV)


class BertForSequenceClassification(nn.Module):
    """A BERT cross-encoder or classifier: ``classify`` takes the CLS states."""

    default_pooling_type = "CLS"

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.num_labels, self.id2label = config.num_labels, config.id2label
        self.bert = BertModel(config, add_pooling_layer=True)
        self.classifier = Linear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.bert(input_ids, positions, attn_metadata)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden_size] CLS states -> [num_seqs, num_labels] logits."""
        assert self.bert.pooler is not None
        return self.classifier(self.bert.pooler(pooled))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        return load_packed_weights(self, _without(weights, ()), _PACKED_QKV)


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.out_proj = Linear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, cls_states: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(cls_states)))


class RobertaForSequenceClassification(nn.Module):
    """A RoBERTa or XLM-R cross-encoder or classifier: ``classify`` takes the CLS
    (``<s>``) states."""

    default_pooling_type = "CLS"

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.num_labels, self.id2label = config.num_labels, config.id2label
        self.roberta = BertModel(config)
        self.classifier = RobertaClassificationHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.roberta(input_ids, positions, attn_metadata)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden_size] CLS states -> [num_seqs, num_labels] logits."""
        return self.classifier(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); an unused pooler is skipped.
        Returns the parameter names loaded."""
        return load_packed_weights(self, _without(weights, ("roberta.pooler.",)),
                                   _PACKED_QKV)
