"""Multi-head latent attention (DeepSeek-V2/V3), the attention block and its paged cache.

``MultiHeadLatentAttention`` is Hugging Face's ``DeepseekV2Attention`` with its parameter
names: the query from ``q_proj``, or with a ``q_lora_rank`` from ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``; ``kv_a_proj_with_mqa`` gives each token's compressed
latent (normalised by ``kv_a_layernorm``) and its shared rope key; ``kv_b_proj``
up-projects the latent into each head's no-rope key and value; ``o_proj``. Rotary covers
the last ``qk_rope_head_dim`` dims of each query head and the shared key; the softmax scale
is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times mscale^2 when the config says
(``mla_softmax_scale``).

``LatentAttention`` is the paged part: it declares its cache (``cache_spec()``: an
``MLASpec``), takes the engine's tensor in ``bind`` and stores each token's latent and
rope key in it, then attends over each request's blocks through the backend of the
cache's device (``vllmpy.attention.mla_backend``: the expanded path for prefill, the
weight-absorbed one for decode).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.attention.mla_backend import MLABackend, MLADims, TorchMLABackend, UpProjection
from vllmpy.core.cache_spec import MLASpec
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm

# DeepSeek's q_a_layernorm and kv_a_layernorm keep the RMSNorm default, whatever the
# config's rms_norm_eps (transformers builds them without it)
LATENT_NORM_EPS = 1e-6


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times mscale^2 with mscale = 0.1 * mscale_all_dim *
    ln(factor) + 1 when the rope scaling is not the default one and names
    ``mscale_all_dim`` (DeepSeek's YaRN: the attention's own share of the magnitude
    correction; the rotary table carries the rest)."""
    scale = qk_head_dim ** -0.5
    if not rope_scaling:
        return scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    all_dim = rope_scaling.get("mscale_all_dim")
    if kind != "default" and all_dim:
        mscale = _yarn_mscale(float(rope_scaling.get("factor") or 1.0), float(all_dim))
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """Paged MLA of one layer over a latent cache [num_blocks, block_size, kv_lora_rank +
    qk_rope_head_dim] (the KV cache dtype), bound by the engine (``bind``) once the
    weights are loaded. ``kv_b_proj`` is the block's up-projection (held, not owned:
    its parameters stay the block's); ``bind`` reads its per-head matrices for the
    absorbed path. ``kv_scale`` is the per-layer scale of an fp8 cache (stored = row /
    scale), 1.0 here: checkpoints ship none for latents. Until ``bind`` the backend is the
    PyTorch one."""

    def __init__(self, dims: MLADims, scale: float, kv_b_proj: Linear) -> None:
        super().__init__()
        self.dims = dims
        self.scale = scale
        self._kv_b_proj = (kv_b_proj,)  # a tuple: not registered as a submodule here
        # empty; placed in the model's dtype with the model, the compute dtype of ``bind``
        self.register_buffer("_dtype_probe", torch.empty(0), persistent=False)
        self.backend: MLABackend = TorchMLABackend(dims, scale)
        self.kv_cache: torch.Tensor | None = None
        self.kv_scale = 1.0
        self.up: UpProjection | None = None

    def cache_spec(self) -> MLASpec:
        return MLASpec(self.dims.kv_lora_rank, self.dims.qk_rope_head_dim)

    def bind(self, kv_cache: torch.Tensor, **backend_args: Any) -> None:
        """Give the layer its cache and the backend of the cache's device (the Triton one
        on CUDA; ``backend_args`` go to it, e.g. a fixed ``num_splits``); the first bind
        also reads the up-projection's per-head matrices from the loaded ``kv_b_proj``."""
        width = self.dims.latent_dim
        if kv_cache.dim() != 3 or kv_cache.shape[2] != width:
            raise ValueError(f"MLA cache must be [num_blocks, block_size, {width}] "
                             f"(kv_lora_rank + qk_rope_head_dim), got {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        if self.up is None or self.up.w_uk.device != kv_cache.device:  # read once
            probe = self.get_buffer("_dtype_probe")
            self.up = UpProjection.of(self._kv_b_proj[0], self.dims, probe.dtype,
                                      kv_cache.device)
        if kv_cache.is_cuda:
            from vllmpy.attention.mla_triton_backend import TritonMLABackend

            self.backend = TritonMLABackend(self.dims, self.scale, **backend_args)
        elif not isinstance(self.backend, TorchMLABackend):
            self.backend = TorchMLABackend(self.dims, self.scale)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                k_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), c_kv [T, kv_lora_rank]
        (normalised), k_pe [T, rope] (rotated) -> [T, H * v_head_dim]."""
        if self.kv_cache is None or self.up is None:
            raise RuntimeError("MLA layer used before its latent cache was bound")
        out = self.backend.forward(q_nope, q_pe, c_kv, k_pe, self.kv_cache, meta, self.up,
                                   self.kv_scale)
        return out.reshape(q_nope.shape[0], self.dims.num_heads * self.dims.v_head_dim)


class MultiHeadLatentAttention(nn.Module):
    """The attention block of a DeepSeek-V2/V3 decoder layer; see the module docstring.
    ``rotary`` rotates the rope dims (DeepSeek pairs neighbours: ``is_neox_style=False``);
    ``scale`` is the softmax scale (``mla_softmax_scale``)."""

    def __init__(self, hidden_size: int, num_heads: int, *, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
                 q_lora_rank: int | None, rotary: nn.Module, scale: float,
                 attention_bias: bool = False) -> None:
        super().__init__()
        self.dims = MLADims(num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                            kv_lora_rank)
        self.num_heads = num_heads
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        q_size = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, q_size)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(q_lora_rank, q_size)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                         bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)
        self.rotary_emb = rotary
        self.attn = LatentAttention(self.dims, scale, self.kv_b_proj)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        n, dims = hidden_states.shape[0], self.dims
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(n, self.num_heads, self.qk_head_dim)  # [num_tokens, heads, nope + rope]
        q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # [num_tokens, kv_lora_rank + rope]
        c_kv, k_pe = latent.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        out = self.attn(q_nope, q_pe, c_kv, k_pe, attn_metadata)  # [num_tokens, heads * v]
        return self.o_proj(out)
