"""GPT-NeoX (Pythia, GPT-NeoX-20B), read top to bottom like the Hugging Face modeling file,
over the flattened tokens of one engine step: rotary on the first ``rotary_pct`` of each
head (NeoX pairing), LayerNorm with biases, attention and MLP side by side on the same
input (``use_parallel_residual``, the default) or one after the other, and a separate
``embed_out`` head.

The checkpoint's ``query_key_value`` holds q, k and v interleaved per head (rows
[heads, 3, head_dim]); ``load_weights`` reorders them into the packed [3, heads, head_dim]
of the attention block's ``qkv_proj``.
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
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import load_packed_weights


@dataclass(frozen=True)
class GPTNeoXConfig(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int  # the dims of each head that rotate (head_dim * rotary_pct)
    use_parallel_residual: bool  # x + attn(ln1(x)) + mlp(ln2(x)); else one after the other
    attention_bias: bool  # query_key_value and dense carry biases

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> GPTNeoXConfig:
        r = ConfigReader(cfg, architecture)
        act = r.get("hidden_act", "gelu", str)
        try:
            check_activation(act, "hidden_act", gated=False)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        fields = decoder_fields(r, architecture)
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        if hidden % heads:
            raise ConfigError(f"{architecture} config: hidden_size ({hidden}) must be a "
                              f"multiple of num_attention_heads ({heads})")
        fields.update(num_key_value_heads=heads, head_dim=hidden // heads)
        theta, scaling = rope_settings(r)
        params = r.cfg.get("rope_parameters")
        params = params if isinstance(params, dict) else {}
        # older configs: rotary_emb_base and rotary_pct (default 0.25) beside the rest
        if "rope_theta" not in params and r.has("rotary_emb_base"):
            theta = r.get("rotary_emb_base", theta, float)
        pct = params.get("partial_rotary_factor", r.get("rotary_pct", 0.25, float))
        if not isinstance(pct, (int, float)) or not 0 < pct <= 1:
            raise ConfigError(f"{architecture} config: the rotary fraction (rotary_pct / "
                              f"partial_rotary_factor) must be in (0, 1], got {pct!r}")
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        return cls(**fields, intermediate_size=r.need("intermediate_size"), hidden_act=act,
                   layer_norm_eps=r.get("layer_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   rotary_dim=int(fields["head_dim"] * pct),
                   use_parallel_residual=r.get("use_parallel_residual", True, bool),
                   attention_bias=r.get("attention_bias", True, bool))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling,
                                 rotary_dim=config.rotary_dim)
        self.attention = SelfAttention(hidden, config.num_attention_heads,
                                       config.num_attention_heads, config.head_dim,
                                       rotary=rotary, qkv_bias=config.attention_bias,
                                       o_bias=config.attention_bias)
        self.mlp = PlainMLP(hidden, config.intermediate_size, config.hidden_act,
                            names=("dense_h_to_4h", "dense_4h_to_h"))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        attn_output = self.attention(positions, self.input_layernorm(hidden_states),
                                     attn_metadata)
        if self.use_parallel_residual:
            mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
            return mlp_output + attn_output + hidden_states
        attn_output = attn_output + hidden_states
        return self.mlp(self.post_attention_layernorm(attn_output)) + attn_output


class GPTNeoXModel(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.embed_in = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [GPTNeoXLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_in(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.final_layer_norm(hidden_states)


def _qkv_per_head_to_packed(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """query_key_value rows [heads, 3, head_dim] (weight or bias) -> [3, heads, head_dim]."""
    rows = tensor.shape[0]
    per_head = tensor.reshape(heads, 3, rows // (3 * heads), *tensor.shape[1:])
    return per_head.transpose(0, 1).reshape(tensor.shape)


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config: GPTNeoXConfig) -> None:
        super().__init__()
        self.config = config
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = (None if config.tie_word_embeddings
                          else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.gpt_neox(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.embed_out, self.gpt_neox.embed_in, hidden_states, out)

    def _hf_to_model(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """query_key_value reordered into qkv_proj, dense is o_proj; the head is embed_out
        in checkpoints and lm_head where transformers 5 saved it."""
        heads = self.config.num_attention_heads
        for name, tensor in weights:
            if ".attention.query_key_value." in name:
                name = name.replace(".query_key_value.", ".qkv_proj.")
                tensor = _qkv_per_head_to_packed(tensor, heads)
            name = name.replace(".attention.dense.", ".attention.o_proj.")
            if name.startswith("lm_head."):
                name = f"embed_out.{name.removeprefix('lm_head.')}"
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names); returns the parameter names loaded."""
        # the causal-mask buffers and rotary frequencies older checkpoints saved
        skip: tuple[str, ...] = (".attention.bias", ".attention.masked_bias",
                                 "rotary_emb.inv_freq")
        if self.config.tie_word_embeddings:
            skip += ("embed_out.weight",)
        scales = KVScaleLoader(self)
        return load_packed_weights(self, scales.filter(self._hf_to_model(weights)), {},
                                   skip) | scales.loaded
