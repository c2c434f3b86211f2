"""Normalization layers, each with the residual add fused into the same call (vLLM's
convention): ``norm(x)`` is the normalized x; ``norm(x, residual)`` is
``(normalized(x + residual), x + residual)``.

- ``RMSNorm``: ``w * rms_normalized(x)`` (Llama, Qwen, Mistral, OLMo-2, ...), a fused
  Triton kernel on CUDA, a C kernel on the CPU (``vllmpy.ops.cpu_kernels``);
- ``GemmaRMSNorm``: ``(1 + w) * rms_normalized(x)``, the product taken in fp32 before the
  one rounding (Gemma's own arithmetic);
- ``LayerNorm``: mean and variance, with an optional bias (GPT-2, OPT, GPT-NeoX, StableLM,
  Starcoder2, Cohere).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.layers.custom_op import CustomOp
from vllmpy.ops import cpu_kernels
from vllmpy.ops.native import rms_norm_cpu

Normed = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class RMSNorm(CustomOp):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self._cpu: Any = None  # the C kernels, once bound to a CPU that has them

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Normed:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual)."""
        lib = self._cpu
        if lib is not None and cpu_kernels.takes_rows(
                x, self.weight.view(1, -1), *(() if residual is None else (residual,))):
            out, summed = cpu_kernels.add_rms_norm(
                lib, x, residual, self.weight, self.eps, cpu_kernels.threads_for(x.numel()))
            return out if summed is None else (out, summed)
        if residual is None:
            return rms_norm_cpu(x, self.weight, self.eps)
        x = x + residual
        return rms_norm_cpu(x, self.weight, self.eps), x

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        self._cpu = cpu_kernels.kernels() if device.type == "cpu" else None
        if self.on_cuda:
            from vllmpy.ops import fused

            self._fused = fused

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Normed:
        return self._fused.rms_norm(x, self.weight, self.eps, residual)  # one launch


class GemmaRMSNorm(CustomOp):
    """Gemma's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` all in fp32, rounded once
    to x's dtype. The checkpoint stores ``w`` (zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Normed:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(CustomOp):
    """``F.layer_norm`` with a weight and (unless ``bias=False``) a bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(hidden_size), requires_grad=False)
                     if bias else None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Normed:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
