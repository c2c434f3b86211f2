"""Attention backends over the paged KV cache.

A backend stores the step's new keys and values into the cache, then computes causal
attention of each request's new queries over all of that request's cached tokens.
The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllmpy.attention.metadata import AttentionMetadata


class AttentionBackend:
    """Contract: ``forward(q, k, v, kv_cache, meta)`` with q [num_tokens, num_heads, head_dim],
    k and v [num_tokens, num_kv_heads, head_dim]; writes k and v at ``meta.slot_mapping``
    and returns [num_tokens, num_heads, head_dim]."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store k and v ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, kv_heads, head_dim]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchReferenceBackend(AttentionBackend):
    """Gathers each request's blocks and runs ``scaled_dot_product_attention``.

    Plain and slow, but easy to trust: the CPU path and the reference for kernels.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = meta.num_actual_tokens
        write_kv_cache(k[:num_tokens], v[:num_tokens], kv_cache, meta.slot_mapping[:num_tokens])
        out = torch.empty_like(q)
        starts = meta.query_start_loc_cpu
        group = self.num_heads // self.num_kv_heads
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            num_blocks = -(-seq_len // meta.block_size)
            blocks = meta.block_tables[i, :num_blocks].long()
            # [num_blocks, block_size, kv_heads, head_dim] -> [seq_len, kv_heads, head_dim]
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].to(q.dtype)
            values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].to(q.dtype)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            query = q[q_start:q_end].transpose(0, 1)  # [heads, q_len, head_dim]
            mask = None
            if q_len > 1:
                # query j sits at position seq_len - q_len + j and sees keys up to there
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
            attn = F.scaled_dot_product_attention(
                query, keys.transpose(0, 1), values.transpose(0, 1),
                attn_mask=mask, scale=self.scale)
            out[q_start:q_end] = attn.transpose(0, 1)
        return out
