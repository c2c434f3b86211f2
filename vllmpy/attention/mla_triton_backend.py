"""The CUDA MLA backend: Triton kernels over the paged latent cache
(``vllmpy.ops.mla_attention``)."""

from __future__ import annotations

import torch

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.attention.mla_backend import (
    MLABackend,
    MLADims,
    UpProjection,
    decode_rows,
    expanded_attention,
    gather_latents,
)
from vllmpy.ops.mla_attention import absorbed_attention, write_latents


class TritonMLABackend(MLABackend):
    """Same contract and results as ``TorchMLABackend``.

    ``write_latents`` stores the step's rows (negative slots are padding and not stored).
    When the step's host copies show no request of more than one query (every decode
    step; and every CUDA graph capture, whose host copies hold no real request), one
    ``absorbed_attention`` launch covers every row of the batch, prefill chunks included,
    from device tensors alone, so a captured graph replays any step of its shape. In an
    eager step with longer requests those take the expanded path (their latents
    up-projected, ``scaled_dot_product_attention`` on the gathered rows) and the kernel
    only the one-query requests. ``num_splits``, when set, fixes the split-KV count, as
    CUDA graph replays need.
    """

    def __init__(self, dims: MLADims, scale: float, num_splits: int | None = None) -> None:
        super().__init__(dims, scale)
        self.num_splits = num_splits

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor,
                k_pe: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                up: UpProjection, kv_scale: float = 1.0) -> torch.Tensor:
        n = meta.num_actual_tokens
        write_latents(c_kv[:n], k_pe[:n].contiguous(), kv_cache, meta.slot_mapping[:n],
                      kv_scale)
        dims = self.dims
        ones, longer = decode_rows(meta)
        starts = meta.query_start_loc_cpu
        max_seq_len = meta.max_seq_len or max(meta.seq_lens_cpu, default=0)
        if not longer:
            max_query_len = meta.max_query_len or max(
                (b - a for a, b in zip(starts, starts[1:])), default=0)
            o_lat = self._absorbed(up.absorb(q_nope), q_pe, kv_cache, meta, kv_scale,
                                   max_query_len, max_seq_len, None)
            return up.values(o_lat)
        out = q_nope.new_empty(q_nope.shape[0], dims.num_heads, dims.v_head_dim)
        if ones:
            tokens = torch.tensor([starts[i] for i in ones], device=q_nope.device)
            q_lat = q_nope.new_empty(q_nope.shape[0], dims.num_heads, dims.kv_lora_rank)
            q_lat[tokens] = up.absorb(q_nope[tokens])
            o_lat = self._absorbed(q_lat, q_pe, kv_cache, meta, kv_scale, 1, max_seq_len, 1)
            out[tokens] = up.values(o_lat[tokens])
        for i in longer:
            seq_len = meta.seq_lens_cpu[i]
            blocks = meta.block_tables[i, :-(-seq_len // meta.block_size)].long()
            latents = gather_latents(kv_cache, blocks, seq_len, q_nope.dtype, kv_scale)
            rows = slice(starts[i], starts[i + 1])
            out[rows] = expanded_attention(q_nope[rows], q_pe[rows], latents, up, dims,
                                           self.scale)
        return out

    def _absorbed(self, q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata, kv_scale: float, max_query_len: int,
                  max_seq_len: int, only_up_to: int | None) -> torch.Tensor:
        """o_lat [T, H, kv_lora_rank] of the requests of at most ``only_up_to`` queries
        (None: all); the other rows are left unspecified."""
        o_lat = q_lat.new_empty(q_lat.shape[0], self.dims.num_heads, self.dims.kv_lora_rank)
        if q_pe.stride(-1) != 1:
            q_pe = q_pe.contiguous()
        return absorbed_attention(
            q_lat, q_pe, kv_cache, o_lat, meta.query_start_loc, meta.seq_lens,
            meta.block_tables, scale=self.scale, max_query_len=max_query_len,
            max_seq_len=max_seq_len, kv_scale=kv_scale, max_query_len_absorbed=only_up_to,
            num_splits=self.num_splits)
