"""NomicBERT (nomic-embed-text-v1/v1.5): an encoder-only model for the pooling runner,
read top to bottom like nomic's own modeling file (``contrastors``, remote code; its
config.json is GPT-2-styled: ``n_embd``, ``n_head``...), over the packed whole prompts of
one step.

Word and token-type embeddings (no position embeddings) are summed and LayerNormed
(``emb_ln``); each post-LN block is bidirectional attention through one fused ``Wqkv``
with rotary positions on q and k (``rotary_emb_fraction`` of each head, halves or
neighbours as ``rotary_emb_interleaved`` says) and ``out_proj``, the residual and
``norm1``; then a SwiGLU MLP, ``fc2(fc11(x) * silu(fc12(x)))``, the residual and
``norm2``. Biases are there only where the config says (``qkv_proj_bias`` also covers
``out_proj``; ``mlp_fc1_bias``, ``mlp_fc2_bias``).

The engine hands no token type ids and an embedding model embeds single texts, so every
token is type 0 (what nomic's model, and llama.cpp's, use when none are given).

Also loads llama.cpp's ``nomic-bert`` GGUF (``GGUF_ARCH``): its metadata maps onto the
config keys above and its tensor names onto nomic's.
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
from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.encoder_attention import encoder_attention
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import LayerNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader
from vllmpy.models.weights import load_packed_weights


@dataclass(frozen=True)
class NomicBertConfig(TextModelConfig):
    n_inner: int  # the MLP's width
    layer_norm_epsilon: float
    type_vocab_size: int
    rotary_dim: int  # leading dims of each head that rotate
    rotary_emb_base: float
    rotary_emb_interleaved: bool  # rotate neighbouring pairs (else the two halves)
    qkv_proj_bias: bool  # Wqkv and out_proj
    mlp_fc1_bias: bool  # fc11 and fc12
    mlp_fc2_bias: bool

    ENCODER_ONLY = True

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> NomicBertConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("activation_function", ("swiglu",), "swiglu")
        for key, why in (("prenorm", "NomicBERT embedders are post-LN"),
                         ("causal", "an encoder-only model attends both ways"),
                         ("parallel_block", "the blocks run attention then MLP"),
                         ("use_rms_norm", "the norms are LayerNorms")):
            r.refuse(key, unless=False, why=why)
        r.refuse("rotary_scaling_factor", why="dynamic-NTK rotary is not implemented")
        r.refuse("rotary_emb_scale_base", why="xPos rotary is not implemented")
        hidden, heads = r.need("n_embd"), r.need("n_head")
        layers = r.need("n_layer")
        if hidden <= 0 or heads <= 0 or layers <= 0 or hidden % heads:
            raise ConfigError(f"{architecture} config: n_embd ({hidden}) must be a positive "
                              f"multiple of n_head ({heads}), and n_layer ({layers}) positive")
        head_dim = hidden // heads
        fraction = r.get("rotary_emb_fraction", 1.0, float)
        rotary_dim = int(head_dim * fraction)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ConfigError(f"{architecture} config 'rotary_emb_fraction'={fraction!r} "
                              f"gives {rotary_dim} rotary dims of head_dim {head_dim}; "
                              "they must be even and in (0, head_dim]")
        return cls(
            architectures=[architecture], model_type=str(r.get("model_type", "nomic_bert")),
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=head_dim,
            # plain rotary serves what it was trained on (n_positions is the nominal 8192)
            max_position_embeddings=r.first(("max_trained_positions", "n_positions"), 2048),
            vocab_size=r.need("vocab_size"), tie_word_embeddings=False,
            layer_windows=(None,) * layers,
            n_inner=r.get("n_inner", 4 * hidden, int),
            layer_norm_epsilon=r.get("layer_norm_epsilon", 1e-12, float),
            type_vocab_size=r.get("type_vocab_size", 2, int),
            rotary_dim=rotary_dim, rotary_emb_base=r.get("rotary_emb_base", 10000.0, float),
            rotary_emb_interleaved=r.get("rotary_emb_interleaved", False, bool),
            qkv_proj_bias=r.get("qkv_proj_bias", True, bool),
            mlp_fc1_bias=r.get("mlp_fc1_bias", True, bool),
            mlp_fc2_bias=r.get("mlp_fc2_bias", True, bool))


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = VocabEmbedding(config.type_vocab_size,
                                                    config.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # every token is type 0: [num_tokens, hidden_size]
        return self.word_embeddings(input_ids) + self.token_type_embeddings.weight[0]


class NomicBertAttention(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.Wqkv = Linear(hidden, 3 * hidden, bias=config.qkv_proj_bias)
        self.out_proj = Linear(hidden, hidden, bias=config.qkv_proj_bias)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rotary_emb_base,
            rotary_dim=config.rotary_dim, is_neox_style=not config.rotary_emb_interleaved)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        # [num_tokens, 3, num_heads, head_dim] -> q, k, v [num_tokens, num_heads, head_dim]
        q, k, v = self.Wqkv(hidden_states).view(
            -1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(encoder_attention(q, k, v, attn_metadata))


class NomicBertGatedMLP(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.n_inner
        self.fc11 = Linear(hidden, inner, bias=config.mlp_fc1_bias)  # up
        self.fc12 = Linear(hidden, inner, bias=config.mlp_fc1_bias)  # gate
        self.fc2 = Linear(inner, hidden, bias=config.mlp_fc2_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc11(x) * F.silu(self.fc12(x)))


class NomicBertBlock(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.attn = NomicBertAttention(config)
        self.norm1 = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mlp = NomicBertGatedMLP(config)
        self.norm2 = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.norm1(self.attn(positions, hidden_states, attn_metadata)
                                   + hidden_states)
        return self.norm2(self.mlp(hidden_states) + hidden_states)


class NomicBertEncoder(nn.Module):
    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([NomicBertBlock(config)
                                     for _ in range(config.num_hidden_layers)])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return hidden_states


class NomicBertModel(nn.Module):
    """The bare encoder: forward gives the last layer's states, [num_tokens, hidden_size]."""

    default_pooling_type = "CLS"  # vLLM's (BertWithRope); nomic's own recipe pools MEAN

    def __init__(self, config: NomicBertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_ln = LayerNorm(config.hidden_size, config.layer_norm_epsilon)
        self.encoder = NomicBertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.emb_ln(self.embeddings(input_ids))
        return self.encoder(positions, hidden_states, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (nomic's names); returns the parameter names loaded."""
        return load_packed_weights(self, weights, {}, ("embeddings.position_ids",))


def _gguf_config(f: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """nomic's config keys from llama.cpp's metadata: the rotary always turns halves
    (llama.cpp's NEOX rope for nomic-bert), and a bias is there when its tensor is."""
    arch = f.architecture
    names = f.tensor_names
    head_dim = common["hidden_size"] // common["num_attention_heads"]
    rope_dim = f.metadata(f"{arch}.rope.dimension_count", head_dim)
    types = f.metadata("tokenizer.ggml.token_type_count",
                       f.metadata(f"{arch}.token_type_count", 2))
    return {"n_embd": common["hidden_size"], "n_head": common["num_attention_heads"],
            "n_layer": common["num_hidden_layers"], "n_inner": common.get("intermediate_size"),
            "n_positions": common["max_position_embeddings"],
            "layer_norm_epsilon": common.get("layer_norm_eps", 1e-12),
            "rotary_emb_base": common.get("rope_theta", 10000.0),
            "rotary_emb_fraction": int(rope_dim) / head_dim, "rotary_emb_interleaved": False,
            "causal": bool(f.metadata(f"{arch}.attention.causal", False)),
            "type_vocab_size": int(types), "activation_function": "swiglu",
            "qkv_proj_bias": "blk.0.attn_qkv.bias" in names,
            "mlp_fc1_bias": "blk.0.ffn_up.bias" in names,
            "mlp_fc2_bias": "blk.0.ffn_down.bias" in names,
            # llama.cpp's pooling (1 mean, 2 CLS, 3 last): the pooling runner's default
            "gguf_pooling_type": {1: "MEAN", 2: "CLS", 3: "LAST"}.get(
                int(f.metadata(f"{arch}.pooling_type", 0)))}


# llama.cpp's "nomic-bert": fused attn_qkv, token types, post-LN, SwiGLU (ffn_up = fc11)
GGUF_ARCH = GGUFArch(
    config=_gguf_config,
    block_parts={"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj",
                 "attn_output_norm": "norm1", "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12",
                 "ffn_down": "mlp.fc2", "layer_output_norm": "norm2"},
    global_names={"token_embd.weight": "embeddings.word_embeddings.weight",
                  "token_types.weight": "embeddings.token_type_embeddings.weight",
                  "token_embd_norm.weight": "emb_ln.weight",
                  "token_embd_norm.bias": "emb_ln.bias"},
    layer_prefix="encoder.layers")
