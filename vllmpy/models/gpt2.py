"""GPT-2, read top to bottom like the Hugging Face modeling file, over the flattened tokens
of one engine step: learned absolute positions (``wpe``) added to the token embeddings,
pre-LayerNorm blocks with biases, one fused ``c_attn`` projection, a plain ``gelu_new``
MLP and a head tied to ``wte``.

The checkpoint's projections are ``Conv1D`` layers, whose weights are stored [in, out];
``load_weights`` turns them into the [out, in] of ``Linear``. ``c_attn``/``c_proj`` of the
attention load into the attention block's ``qkv_proj``/``o_proj``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.activation import check_activation
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear
from vllmpy.layers.mlp import PlainMLP
from vllmpy.layers.norm import LayerNorm
from vllmpy.layers.quantization.gguf import QuantizedTensor
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader
from vllmpy.models.weights import load_packed_weights


@dataclass(frozen=True)
class GPT2Config(TextModelConfig):
    n_inner: int  # the MLP's width (config null: 4 * n_embd)
    activation_function: str
    layer_norm_epsilon: float
    scale_attn_weights: bool  # scores times head_dim ** -0.5 (else unscaled)
    scale_attn_by_inverse_layer_idx: bool  # scores of layer i also divided by i + 1

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GPT2Config:
        r = ConfigReader(cfg, architecture)
        act = r.get("activation_function", "gelu_new", str)
        try:
            check_activation(act, "activation_function", gated=False)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        r.refuse("add_cross_attention", unless=False,
                 why="a decoder-only engine has no encoder states to attend to")
        # reorder_and_upcast_attn (scores and softmax in float32) is how every attention
        # backend here computes them already, so any value runs as Hugging Face's does
        hidden = r.first(("n_embd", "hidden_size"))
        heads = r.first(("n_head", "num_attention_heads"))
        layers = r.first(("n_layer", "num_hidden_layers"))
        if hidden <= 0 or heads <= 0 or layers <= 0 or hidden % heads:
            raise ConfigError(f"{architecture} config: n_embd ({hidden}) must be a positive "
                              f"multiple of n_head ({heads}), and n_layer ({layers}) positive")
        return cls(
            architectures=[architecture], model_type=str(r.get("model_type", "gpt2")),
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=heads, head_dim=hidden // heads,
            # wpe has one row per position: nothing past it can be served
            max_position_embeddings=r.first(("n_positions", "max_position_embeddings"), 1024),
            vocab_size=r.need("vocab_size"),
            tie_word_embeddings=r.get("tie_word_embeddings", True, bool),
            layer_windows=(None,) * layers,
            n_inner=r.get("n_inner", 4 * hidden, int),
            activation_function=act,
            layer_norm_epsilon=r.get("layer_norm_epsilon", 1e-5, float),
            scale_attn_weights=r.get("scale_attn_weights", True, bool),
            scale_attn_by_inverse_layer_idx=r.get("scale_attn_by_inverse_layer_idx", False,
                                                  bool))


class GPT2Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = SelfAttention(hidden, config.num_attention_heads,
                                  config.num_attention_heads, config.head_dim, rotary=None,
                                  scale=scale, qkv_bias=True, o_bias=True)
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = PlainMLP(hidden, config.n_inner, config.activation_function,
                            names=("c_fc", "c_proj"))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.ln_1(hidden_states)
        else:
            hidden_states, residual = self.ln_1(hidden_states, residual)
        hidden_states = self.attn(positions, hidden_states, attn_metadata)
        hidden_states, residual = self.ln_2(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([GPT2Block(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, n_embd]
        residual = None
        for block in self.h:
            hidden_states, residual = block(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.ln_f(hidden_states, residual)
        return hidden_states


# Conv1D weights ([in, out]) of a block, and where the attention's two land
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ATTN_RENAMES = {"attn.c_attn.": "attn.qkv_proj.", "attn.c_proj.": "attn.o_proj."}
# the causal-mask buffers older checkpoints saved beside the weights
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _hf_to_model(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint names and layouts -> the model's: the ``transformer.`` prefix that the
    original OpenAI checkpoints lack, Conv1D weights transposed to [out, in] (a GGUF
    file's quantized matrices are stored that way already), c_attn/c_proj renamed."""
    for name, tensor in weights:
        if name.endswith(_MASK_BUFFERS):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        if name.endswith(_CONV1D) and not isinstance(tensor, QuantizedTensor):
            tensor = tensor.t()  # [in, out] -> [out, in]
        for old, new in _ATTN_RENAMES.items():
            name = name.replace(old, new)
        yield name, tensor


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.transformer.wte, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(_hf_to_model(weights)), {},
                                   skip) | scales.loaded


def _gguf_config(f: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's own spellings of the common keys."""
    return {"n_embd": common["hidden_size"], "n_layer": common["num_hidden_layers"],
            "n_head": common["num_attention_heads"],
            "n_positions": common["max_position_embeddings"],
            "n_inner": common.get("intermediate_size"),
            "layer_norm_epsilon": common.get("layer_norm_eps", 1e-5)}


def _gguf_to_conv1d(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """llama.cpp's converter stored the Conv1D weights transposed ([out, in]); back to the
    checkpoint's [in, out], which ``load_weights`` reads."""
    return tensor.t() if name.endswith(_CONV1D) else tensor


# llama.cpp's "gpt2": fused attn_qkv, learned positions, LayerNorm biases everywhere
GGUF_ARCH = GGUFArch(
    config=_gguf_config,
    block_parts={"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                 "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    global_names={"token_embd.weight": "transformer.wte.weight",
                  "position_embd.weight": "transformer.wpe.weight",
                  "output_norm.weight": "transformer.ln_f.weight",
                  "output_norm.bias": "transformer.ln_f.bias"},
    layer_prefix="transformer.h",
    transform=_gguf_to_conv1d)
