"""StableLM (StableLM-2, StableLM-3B-4E1T, Zephyr), read top to bottom like the Hugging
Face modeling file, over the flattened tokens of one engine step: rotary on the first
``partial_rotary_factor`` of each head, LayerNorms with biases, a gated SiLU MLP, optional
q/k/v biases, an optional LayerNorm on each head of q and k with weights of its own per
head (``qk_layernorm``), and attention and MLP side by side on one normalized input
(``use_parallel_residual``) or one after the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
from vllmpy.layers.norm import LayerNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata
from vllmpy.models.config_reader import ConfigReader, decoder_fields, rope_settings
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


@dataclass(frozen=True)
class StableLmConfig(TextModelConfig):
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int  # the dims of each head that rotate (head_dim * partial_rotary_factor)
    use_qkv_bias: bool
    qk_layernorm: bool  # a LayerNorm (no bias) on each head of q and k, weights per head
    use_parallel_residual: bool  # x + attn(ln(x)) + mlp(ln(x)); else one after the other

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> StableLmConfig:
        r = ConfigReader(cfg, architecture)
        act = r.get("hidden_act", "silu", str)
        try:
            check_activation(act, "hidden_act", gated=True)
        except ValueError as e:
            raise ConfigError(f"{architecture} config: {e}") from None
        fields = decoder_fields(r, architecture)
        hidden, heads = fields["hidden_size"], fields["num_attention_heads"]
        if hidden % heads:
            raise ConfigError(f"{architecture} config: hidden_size ({hidden}) must be a "
                              f"multiple of num_attention_heads ({heads})")
        fields["head_dim"] = hidden // heads  # what the modeling file uses, whatever is set
        # transformers' StableLmConfig defaults where they differ from Llama's
        fields["max_position_embeddings"] = r.get("max_position_embeddings", 4096, int)
        fields["num_key_value_heads"] = r.get("num_key_value_heads", 32, int)
        theta, scaling = rope_settings(r)
        params = r.cfg.get("rope_parameters")
        params = params if isinstance(params, dict) else {}
        factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor", 0.25,
                                                           float))
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigError(f"{architecture} config 'partial_rotary_factor' must be in "
                              f"(0, 1], got {factor!r}")
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        return cls(**fields, intermediate_size=r.need("intermediate_size"), hidden_act=act,
                   layer_norm_eps=r.get("layer_norm_eps", 1e-5, float),
                   rope_theta=theta, rope_scaling=scaling,
                   rotary_dim=int(fields["head_dim"] * factor),
                   use_qkv_bias=r.get("use_qkv_bias", False, bool),
                   qk_layernorm=r.get("qk_layernorm", False, bool),
                   use_parallel_residual=r.get("use_parallel_residual", False, bool))


class StableLmLayerNormPerHead(nn.Module):
    """A LayerNorm without bias over each head, every head with its own weight: ``weight``
    is [num_heads, head_dim] (Hugging Face keeps one ``norms.<h>`` module per head;
    ``load_weights`` stacks them). Takes and returns [num_tokens, num_heads * head_dim]."""

    def __init__(self, num_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, num_heads, head_dim], in float32 and rounded once, as nn.LayerNorm is
        heads = x.float().view(x.shape[0], *self.weight.shape)
        normed = F.layer_norm(heads, (heads.shape[-1],), None, None, self.eps)
        return (normed * self.weight.float()).view(x.shape).to(x.dtype)


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        hidden, eps, head_dim = config.hidden_size, config.layer_norm_eps, config.head_dim
        self.use_parallel_residual = config.use_parallel_residual
        rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling, rotary_dim=config.rotary_dim)

        def qk_norm(width: int) -> nn.Module:
            return StableLmLayerNormPerHead(width // head_dim, head_dim, eps)

        self.self_attn = SelfAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            rotary=rotary, qkv_bias=config.use_qkv_bias,
            qk_norm=qk_norm if config.qk_layernorm else None, qk_norm_per_head=False)
        self.mlp = GatedMLP(hidden, config.intermediate_size, act=config.hidden_act)
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = (None if config.use_parallel_residual
                                         else LayerNorm(hidden, eps))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        attn_output = self.self_attn(positions, hidden_states, attn_metadata)
        if self.post_attention_layernorm is None:  # parallel: both read the one norm
            return residual + attn_output + self.mlp(hidden_states)
        residual = residual + attn_output
        return residual + self.mlp(self.post_attention_layernorm(residual))


class StableLmModel(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [StableLmDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, attn_metadata)
        return self.norm(hidden_states)


def _stack_head_norms(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``self_attn.{q,k}_layernorm.norms.<h>.weight`` (one tensor per head) ->
    ``self_attn.{q,k}_norm.weight`` [num_heads, head_dim], yielded once every head of it
    has come; the stacked ``{q,k}_layernorm.weight`` of a GGUF file is renamed alike."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        for kind in ("q", "k"):
            old = f".self_attn.{kind}_layernorm."
            if old not in name:
                continue
            head_part = name.split(old, 1)[1]  # "norms.<h>.weight" or "weight"
            target = name.split(old, 1)[0] + f".self_attn.{kind}_norm.weight"
            if head_part == "weight":
                yield target, tensor
            else:
                pending.setdefault(target, {})[int(head_part.split(".")[1])] = tensor
            break
        else:
            yield name, tensor
    for target, heads in pending.items():
        if sorted(heads) != list(range(len(heads))):
            raise ValueError(f"checkpoint per-head norms of {target!r} are not heads "
                             f"0..{len(heads) - 1}: got {sorted(heads)}")
        yield target, torch.stack([heads[h] for h in range(len(heads))])


class StableLmForCausalLM(nn.Module):
    def __init__(self, config: StableLmConfig) -> None:
        super().__init__()
        self.config = config
        self.model = StableLmModel(config)
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
        return load_packed_weights(self, scales.filter(_stack_head_norms(weights)),
                                   PACKED_QKV_GATE_UP, skip) | scales.loaded


def _gguf_config(f: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's converter keeps of the config beside the common keys; the biases and
    q/k norms are known by their tensors."""
    names = f.tensor_names
    return {"use_parallel_residual": bool(f.metadata("stablelm.use_parallel_residual", True)),
            "use_qkv_bias": "blk.0.attn_q.bias" in names,
            "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
            # rope.dimension_count equal to head_dim (no key in the common config) is 1.0
            "partial_rotary_factor": common.get("partial_rotary_factor", 1.0)}


# llama.cpp's "stablelm": the common names, LayerNorm biases, the stacked per-head norms
GGUF_ARCH = GGUFArch(config=_gguf_config,
                     block_parts={"attn_q_norm": "self_attn.q_layernorm",
                                  "attn_k_norm": "self_attn.k_layernorm"},
                     global_names={"output_norm.bias": "model.norm.bias"})
