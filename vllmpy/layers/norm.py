"""RMSNorm, with the residual add fused into the same call (vLLM's convention)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype
    before the weight multiplies it."""
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(orig_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from vllmpy.ops.fused import rms_norm  # one fused kernel instead of ~8

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
