"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on q, k and v, none
on the output projection, an optional sliding window on the layers ``layer_types`` names)
with a sparse MoE MLP on every ``decoder_sparse_step``-th layer outside
``mlp_only_layers`` and a dense gated MLP of ``intermediate_size`` on the rest. The MoE
MLP routes each token to its top-k experts by softmax (renormalised with
``norm_topk_prob``) and adds a shared expert that every token takes, scaled by
sigmoid(``shared_expert_gate``(x)); read top to bottom like the Hugging Face modeling file.

From GGUF (llama.cpp's ``qwen2moe``): every layer is sparse, the router's top-k
probabilities are used as they are (llama.cpp does not renormalise them for this
architecture, whatever the source config said), and ``ffn_gate_inp_shexp`` may come as
one vector [hidden] (older converters squeezed it) or as the [1, hidden] matrix the
current converter writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError, TextModelConfig
from vllmpy.layers.attention import KVScaleLoader, SelfAttention
from vllmpy.layers.embedding import VocabEmbedding, head_logits
from vllmpy.layers.linear import Linear, rms_norm_linear, tie_quantized_lm_head
from vllmpy.layers.mlp import GatedMLP
from vllmpy.layers.moe import SparseMoeBlock
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import RotaryEmbedding
from vllmpy.loader.gguf_arch import GGUFArch, GGUFMetadata, moe_config
from vllmpy.models.config_reader import (
    ConfigReader,
    decoder_fields,
    layer_types,
    rope_settings,
    windows_of,
)
from vllmpy.models.weights import PACKED_QKV_GATE_UP, load_packed_weights


def _sliding_windows(r: ConfigReader, layers: int) -> tuple[int | None, ...]:
    """Each layer's window. ``use_sliding_window`` switches windows on; which layers slide
    is ``layer_types`` when given, else transformers 5's rule for this family: the
    even-numbered layers (0, 2, ...) below ``max_window_layers``."""
    use = r.get("use_sliding_window", False, bool)
    window = r.get("sliding_window", None, int) if use else None
    if use and (window is None or window < 1):
        raise ConfigError(f"{r.architecture} config 'use_sliding_window' is true but "
                          f"'sliding_window' is {r.cfg.get('sliding_window')!r}: a window of "
                          "at least one token is needed")
    below = r.get("max_window_layers", 28, int)
    kinds = layer_types(r, layers, ["sliding_attention" if use and i % 2 == 0 and i < below
                                    else "full_attention" for i in range(layers)])
    if not use and "sliding_attention" in kinds:
        raise ConfigError(f"{r.architecture} config 'layer_types' names sliding layers but "
                          "'use_sliding_window' is not true: the layers have no window")
    return windows_of(kinds, window)


@dataclass(frozen=True)
class Qwen2MoeConfig(TextModelConfig):
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each routed expert's
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: the MoE MLP (else the dense one)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> Qwen2MoeConfig:
        r = ConfigReader(cfg, architecture)
        r.expect("hidden_act", ("silu",), "silu")
        r.refuse("partial_rotary_factor", unless=1.0, why="Qwen2-MoE rotates whole heads")
        layers = r.need("num_hidden_layers")
        windows = _sliding_windows(r, layers)
        theta, scaling = rope_settings(r)
        experts = r.get("num_experts", 60, int)
        step = r.get("decoder_sparse_step", 1, int)
        if step < 1:
            raise ConfigError(f"{architecture} config 'decoder_sparse_step'={step} must be "
                              ">= 1")
        dense = r.get("mlp_only_layers", [], list)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
            raise ConfigError(f"{architecture} config 'mlp_only_layers'={dense!r} must list "
                              "layer indices")
        sparse = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                       for i in range(layers))
        top_k = r.get("num_experts_per_tok", 4, int)
        shared = r.get("shared_expert_intermediate_size", 5632, int)
        if any(sparse):
            if not 1 <= top_k <= experts:
                raise ConfigError(f"{architecture} config 'num_experts_per_tok'={top_k} must "
                                  f"lie in 1..num_experts ({experts})")
            if shared < 1:
                raise ConfigError(f"{architecture} config 'shared_expert_intermediate_size'="
                                  f"{shared} is not supported: the MoE layers always carry "
                                  "a shared expert")
        return cls(**decoder_fields(r, architecture, windows),
                   intermediate_size=r.get("intermediate_size", 5632, int),
                   moe_intermediate_size=r.get("moe_intermediate_size", 1408, int),
                   shared_expert_intermediate_size=shared,
                   num_experts=experts, num_experts_per_tok=top_k,
                   norm_topk_prob=r.get("norm_topk_prob", False, bool),
                   sparse_layers=sparse,
                   rms_norm_eps=r.get("rms_norm_eps", 1e-6, float),
                   rope_theta=theta, rope_scaling=scaling,
                   qkv_bias=r.get("qkv_bias", True, bool))


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen2MoeConfig, layer_idx: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.self_attn = SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, rotary=rotary, qkv_bias=config.qkv_bias, o_bias=False,
            sliding_window=config.layer_windows[layer_idx])
        self.mlp: nn.Module
        if config.sparse_layers[layer_idx]:
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.num_experts, config.moe_intermediate_size,
                config.num_experts_per_tok, config.norm_topk_prob,
                shared_intermediate_size=config.shared_expert_intermediate_size,
                shared_gate=True)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = rms_norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
        hidden_states = self.self_attn.forward_qkv(positions, qkv, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen2MoeModel(nn.Module):
    def __init__(self, config: Qwen2MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen2MoeForCausalLM(nn.Module):
    def __init__(self, config: Qwen2MoeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen2MoeModel(config)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        return head_logits(self.lm_head, self.model.embed_tokens, hidden_states, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (Hugging Face names; routed experts one tensor per
        expert projection or stacked per projection); returns the parameter names loaded."""
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
            weights = tie_quantized_lm_head(self, weights)
        scales = KVScaleLoader(self)  # k_scale / v_scale go to the attention layers
        return load_packed_weights(self, scales.filter(weights), PACKED_QKV_GATE_UP,
                                   skip) | scales.loaded


# ---- GGUF: llama.cpp's "qwen2moe" ------------------------------------------------------

def _gguf_config(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    """The MoE keys as llama.cpp runs this architecture: a MoE MLP on every layer, the
    top-k probabilities not renormalised, no sliding window; an expert size the file does
    not give falls back as llama.cpp's does (feed_forward_length over the experts used for
    the routed experts, feed_forward_length itself for the shared one)."""
    arch = meta.architecture
    moe = moe_config(meta, "num_experts")
    for key in ("num_experts", "num_experts_per_tok"):
        if moe.get(key, 0) < 1:
            gguf_key = "expert_count" if key == "num_experts" else "expert_used_count"
            raise ConfigError(f"{meta.path}: {arch}.{gguf_key} is "
                              f"{meta.metadata(f'{arch}.{gguf_key}')!r}; a {arch} file "
                              "needs at least one")
    dense = config.get("intermediate_size")
    if dense is not None:
        moe.setdefault("moe_intermediate_size", dense // moe["num_experts_per_tok"])
        moe.setdefault("shared_expert_intermediate_size", dense)
    return {**moe, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
            "use_sliding_window": False,
            "qkv_bias": "blk.0.attn_q.bias" in meta.tensor_names}  # not in metadata


def _gguf_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The shared expert's gate as the [1, hidden] Linear weight, also from a file that
    holds it as one vector."""
    if name.endswith("mlp.shared_expert_gate.weight") and tensor.dim() == 1:
        return tensor.reshape(1, -1)
    return tensor


GGUF_ARCH = GGUFArch(config=_gguf_config, transform=_gguf_tensor)
