"""The attention layer models call: binds one layer's KV cache to a backend."""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.attention.backend import AttentionBackend, TorchReferenceBackend
from vllmpy.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention for one layer. ``kv_cache`` is bound by the model runner after the
    pool is allocated; ``backend`` may be swapped for a device-specific one."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = TorchReferenceBackend(
            num_heads, num_kv_heads, head_dim, scale)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim], k/v: [num_tokens, num_kv_heads * head_dim]."""
        if self.kv_cache is None:
            raise RuntimeError("attention layer used before its KV cache was bound")
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache, meta)
        return out.reshape(n, self.num_heads * self.head_dim)
