"""The CUDA attention backend: Triton kernels over the paged KV cache."""

from __future__ import annotations

import torch

from vllmpy.attention.backend import AttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops.paged_attention import paged_attention, reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    """Same contract and results as ``TorchReferenceBackend``, in two launches per layer
    (one when the caller stored the keys and values itself):
    ``reshape_and_cache`` stores the step's keys and values, ``paged_attention`` attends
    over the whole mixed batch (split-KV for long decodes). An fp8 cache is written
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
