"""Rotary position embedding (the rotate-half / NeoX layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn

from vllmpy.ops.native import rotary_cpu, rotary_cpu_table


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k, flattened as [num_tokens, num_heads * head_dim].

    The cos/sin table is built on first use on the device of the inputs, in float32, once
    for every layer with the same settings (as is the CPU's own ``rotary_cpu_table``).
    """

    SUPPORTED_SCALING = ("default", "llama3", "linear")
    _tables: ClassVar[dict[tuple[Any, ...], torch.Tensor]] = {}
    _cpu_tables: ClassVar[dict[tuple[Any, ...], torch.Tensor]] = {}

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_scaling = rope_scaling
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind not in self.SUPPORTED_SCALING:
            raise ValueError(f"rope_scaling type {kind!r} is not supported "
                             f"(supported: {', '.join(self.SUPPORTED_SCALING)})")
        self.scaling_kind = kind
        # what the shared tables are keyed by, with the device
        self._table_key = (head_dim, max_position, base, repr(rope_scaling))
        # whether the fused attention kernels may rotate with this table (rotate-half over
        # the whole head)
        self.fusable = True

    def _inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inv_freq = 1.0 / (self.base ** exponents)
        if self.scaling_kind == "llama3":
            assert self.rope_scaling is not None
            inv_freq = _llama3_inv_freq(inv_freq, self.rope_scaling)
        elif self.scaling_kind == "linear":
            assert self.rope_scaling is not None
            inv_freq = inv_freq / float(self.rope_scaling["factor"])
        return inv_freq

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_position, head_dim]: cos in the first half, sin in the second."""
        key = self._settings(device)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = self._cos_sin().to(device)
        return table

    def _settings(self, device: torch.device) -> tuple[Any, ...]:
        return (*self._table_key, device)

    def _cos_sin(self) -> torch.Tensor:
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, self._inv_freq())  # [max_position, head_dim / 2]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def cpu_table(self, device: torch.device) -> torch.Tensor:
        """``rotary_cpu_table`` of this layer's cos/sin, built once per settings and device."""
        key = self._settings(device)
        table = self._cpu_tables.get(key)
        if table is None:
            table = self._cpu_tables[key] = rotary_cpu_table(self._cos_sin()).to(device)
        return table

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:
            from vllmpy.ops.fused import rotary_embedding  # one fused kernel instead of ~10

            cache = self.cos_sin_cache(q.device)
            # [num_tokens, num_heads * head_dim] (a view when q, k already are)
            q2, k2 = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)
            q2, k2 = rotary_embedding(positions, q2, k2, cache, self.head_dim)
            return q2.view(q.shape), k2.view(k.shape)
        return rotary_cpu(positions, q, k, self.cpu_table(q.device), self.head_dim)
