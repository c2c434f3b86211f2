"""RMSNorm, with the residual add fused into the same call (vLLM's convention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype
    before the weight multiplies it."""
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(orig_dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_torch`` in fewer kernels, for the CPU (torch's ``rms_norm`` is not fused
    there: it is a composite of the reference's own fp32 steps).

    bfloat16 and float16 go through ``layer_norm``, which is one fused kernel: [x, -x] has
    mean 0 and variance mean(x^2), so its layer norm is x * rsqrt(mean(x^2) + eps) on the
    first half, normalised in fp32 and rounded to x's dtype. Its fp32 statistics differ from
    the reference's in the last bits, which the rounding hides on all but a few in 100,000
    values (those differ by one unit in the last place). float32 keeps the reference's
    exact numbers through ``rms_norm`` without a weight. The weight multiplies after the
    rounding, as in the reference.
    """
    if x.dtype in (torch.bfloat16, torch.float16):
        hidden = x.shape[-1]
        both = torch.cat([x, x.neg()], dim=-1)  # [..., 2 * hidden]
        normed = F.layer_norm(both, (2 * hidden,), None, None, eps)[..., :hidden]
    else:
        normed = torch.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return weight * normed


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_cpu(x, self.weight, self.eps)

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
