"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of shape [..., 2 * d] (gate and up stacked)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from vllmpy.ops.fused import silu_and_mul  # one fused kernel instead of 3

            # [..., 2 * d] -> [num_tokens, 2 * d] -> [..., d]
            out = silu_and_mul(x.reshape(-1, x.shape[-1]))
            return out.view(*x.shape[:-1], x.shape[-1] // 2)
        return silu_and_mul_torch(x)
