"""The CUDA attention backend: Triton kernels over the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch

from vllmpy.attention.backend import AttentionBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops import decode_attention as fused_decode
from vllmpy.ops.fused import qk_norm_rotary
from vllmpy.ops.paged_attention import paged_attention, reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    """Same contract and results as ``TorchReferenceBackend``, in two launches per layer
    (one when the caller stored the keys and values itself):
    ``reshape_and_cache`` stores the step's keys and values, ``paged_attention`` attends
    over the whole mixed batch (split-KV for long decodes). An fp8 cache is written
    quantized with the layer's ``k_scale``/``v_scale`` and read back through them.

    ``fused_qkv`` takes more of the block into the kernels where they cover it: a pure
    decode step goes from the packed qkv to the attention output in one launch (per-head
    RMSNorm of q and k, rotary, the KV write and attention); a step with prefill tokens
    whose block has per-head RMSNorms (Qwen3) runs the norms, rotary and the KV write in
    one launch before ``paged_attention``.

    Slots below zero in ``meta.slot_mapping`` are padding rows and are not stored; query
    rows past ``meta.query_start_loc[-1]`` are padding and their output is undefined.
    ``num_splits``, when set, fixes the split-KV count, as CUDA graph replays need.
    ``fused_qkv`` takes the block's ``sinks`` (None without) into either path.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 num_splits: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logit_softcap)
        self.num_splits = num_splits

    def _features(self) -> dict[str, Any]:
        """The layer's attention features as the kernels take them (none: the kernels'
        plain variants)."""
        features: dict[str, Any] = {}
        if self.sliding_window is not None:
            features["sliding_window"] = self.sliding_window
        if self.logit_softcap is not None:
            features["logit_softcap"] = self.logit_softcap
        return features

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                k_scale: float = 1.0, v_scale: float = 1.0,
                kv_stored: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
        n = meta.num_actual_tokens
        if not kv_stored:
            reshape_and_cache(k[:n], v[:n], kv_cache, meta.slot_mapping[:n], k_scale, v_scale)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        max_query_len, max_seq_len = _step_maxima(meta)
        paged_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens,
                        meta.block_tables, scale=self.scale, max_query_len=max_query_len,
                        max_seq_len=max_seq_len, num_splits=self.num_splits,
                        k_scale=k_scale, v_scale=v_scale, sinks=sinks, **self._features())
        return out

    def fused_qkv(self, block: Any, qkv: torch.Tensor, positions: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor | None:
        rotary = block.rotary_emb
        if rotary is None or not rotary.fusable:  # the kernels rotate all of each head
            return None
        norms = block.per_head_rms_norms()  # (q_norm, k_norm) or None; unfused if other
        if norms is False:
            return None
        out = self._decode_from_qkv(block, qkv, positions, kv_cache, meta, norms)
        if out is not None or norms is None:
            return out
        # per-head norms and rotary in one launch; the keys and values are stored in the
        # same launch when the cache has the model's dtype
        q, k, v = qkv.split([block.q_size, block.kv_size, block.kv_size], dim=-1)
        q_norm, k_norm = norms
        store = kv_cache.dtype == q.dtype
        slots = meta.slot_mapping[:meta.num_actual_tokens] if store else None
        q, k = qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps,
                              rotary.cos_sin_cache(q.device), self.head_dim,
                              v if store else None, kv_cache if store else None, slots)
        n = q.shape[0]
        out = self.forward(q.view(n, self.num_heads, self.head_dim),
                           k.view(n, self.num_kv_heads, self.head_dim),
                           v.view(n, self.num_kv_heads, self.head_dim),
                           kv_cache, meta, k_scale, v_scale, kv_stored=store,
                           sinks=block.sinks)
        return out.view(n, -1)

    def _decode_from_qkv(self, block: Any, qkv: torch.Tensor, positions: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata,
                         norms: tuple[Any, Any] | None) -> torch.Tensor | None:
        """A pure decode step (one token per request, every row a request's) over a cache
        of the model's dtype, in one launch plus the split merge (vllmpy.ops.
        decode_attention); anything else returns None."""
        max_query_len, max_seq_len = _step_maxima(meta)
        if (max_query_len != 1 or qkv.shape[0] != meta.seq_lens.shape[0]
                or meta.num_actual_tokens != qkv.shape[0]
                or not fused_decode.supports(self.head_dim, kv_cache, qkv.dtype,
                                             **self._features())):
            return None
        n = qkv.shape[0]
        q_norm, k_norm = norms if norms is not None else (None, None)
        out = fused_decode.decode_attention(
            qkv, positions[:n], block.rotary_emb.cos_sin_cache(qkv.device), kv_cache,
            meta.slot_mapping[:n], meta.seq_lens, meta.block_tables,
            num_heads=self.num_heads, scale=self.scale, max_seq_len=max_seq_len,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            eps=0.0 if q_norm is None else q_norm.eps,
            num_splits=self.num_splits, sinks=block.sinks, **self._features())
        return out.reshape(n, self.num_heads * self.head_dim)


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
