"""The CUDA attention backend: Triton kernels over the paged KV cache."""

from __future__ import annotations

import torch

from vllmpy.attention.backend import AttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops import decode_attention as fused_decode
from vllmpy.ops.paged_attention import paged_attention, reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    """Same contract and results as ``TorchReferenceBackend``, in two launches per layer
    (one when the caller stored the keys and values itself):
    ``reshape_and_cache`` stores the step's keys and values, ``paged_attention`` attends
    over the whole mixed batch (split-KV for long decodes). A pure decode step can also
    start from the packed qkv (``decode_from_qkv``): rotary, the write and attention in
    one launch. An fp8 cache is written
    quantized with the layer's ``k_scale``/``v_scale`` and read back through them.

    Slots below zero in ``meta.slot_mapping`` are padding rows and are not stored; query
    rows past ``meta.query_start_loc[-1]`` are padding and their output is undefined.
    ``num_splits``, when set, fixes the split-KV count, as CUDA graph replays need.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 num_splits: int | None = None) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_splits = num_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False) -> torch.Tensor:
        n = meta.num_actual_tokens
        if not kv_stored:
            reshape_and_cache(k[:n], v[:n], kv_cache, meta.slot_mapping[:n], k_scale, v_scale)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        max_query_len, max_seq_len = _step_maxima(meta)
        paged_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                        meta.block_tables, scale=self.scale, max_query_len=max_query_len,
                        max_seq_len=max_seq_len, num_splits=self.num_splits,
                        k_scale=k_scale, v_scale=v_scale)
        return out

    def decode_from_qkv(self, qkv: torch.Tensor, positions: torch.Tensor,
                        cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata, q_norm_weight: torch.Tensor | None = None,
                        k_norm_weight: torch.Tensor | None = None,
                        eps: float = 0.0) -> torch.Tensor | None:
        """A pure decode step (one token per request, every row a request's) over a cache
        of the model's dtype, in one launch plus the split merge (vllmpy.ops.
        decode_attention); anything else returns None for the separate path."""
        max_query_len, max_seq_len = _step_maxima(meta)
        if (max_query_len != 1 or qkv.shape[0] != meta.seq_lens.shape[0]
                or meta.num_actual_tokens != qkv.shape[0]
                or not fused_decode.supports(self.head_dim, kv_cache, qkv.dtype)):
            return None
        n = qkv.shape[0]
        return fused_decode.decode_attention(
            qkv, positions[:n], cos_sin_cache, kv_cache, meta.slot_mapping[:n],
            meta.seq_lens, meta.block_tables,
            num_heads=self.num_heads, scale=self.scale, max_seq_len=max_seq_len,
            q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
            num_splits=self.num_splits)


def _step_maxima(meta: AttentionMetadata) -> tuple[int, int]:
    """(longest query, longest sequence) of the step, from the host copies. Metadata that
    carries them precomputed (``max_query_len``, ``max_seq_len``) saves the per-layer scan."""
    max_query_len = meta.max_query_len or None
    max_seq_len = meta.max_seq_len or None
    if max_query_len is None:
        starts = meta.query_start_loc_cpu
        max_query_len = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    if max_seq_len is None:
        max_seq_len = max(meta.seq_lens_cpu, default=0)
    return max_query_len, max_seq_len
