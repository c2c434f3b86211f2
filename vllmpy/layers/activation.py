"""Activations, by the names Hugging Face configs use (``hidden_act``,
``hidden_activation``, ``activation_function``). A name not listed is refused by name.

Gated forms take ``x`` [..., 2 * d] (gate and up stacked) and return [..., d]; plain forms
keep the shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmpy.layers.custom_op import CustomOp
from vllmpy.ops import cpu_kernels
from vllmpy.ops.native import gelu_and_mul_torch, gelu_new_torch, silu_and_mul_torch

# config name -> the plain function
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": gelu_new_torch,
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
# config name -> F.gelu's ``approximate`` for the gated GELU forms
_GELU_APPROX = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh",
                "gelu_pytorch_tanh": "tanh"}


class UnsupportedActivationError(ValueError):
    pass


def check_activation(name: str, key: str, gated: bool) -> str:
    """``name`` if the engine runs it (gated: as the gate of a gated MLP); else refused
    naming the config ``key``."""
    ok = name in ("silu", "swish", *_GELU_APPROX) if gated else name in PLAIN_ACTIVATIONS
    if not ok:
        kinds = sorted({"silu", "swish", *_GELU_APPROX} if gated else PLAIN_ACTIVATIONS)
        raise UnsupportedActivationError(
            f"{key}={name!r} is not a supported {'gated ' if gated else ''}activation; "
            f"supported: {', '.join(kinds)}")
    return name


class SiluAndMul(CustomOp):
    """silu(x[..., :d]) * x[..., d:] for x of shape [..., 2 * d] (gate and up stacked)."""

    _cpu: Any = None  # the C kernels, once bound to a CPU that has them

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None and cpu_kernels.takes_rows(x):
            return cpu_kernels.silu_and_mul(self._cpu, x, cpu_kernels.threads_for(x.numel()))
        return silu_and_mul_torch(x)

    def bind_device(self, device: torch.device) -> None:
        super().bind_device(device)
        self._cpu = cpu_kernels.kernels() if device.type == "cpu" else None
        if self.on_cuda:
            from vllmpy.ops import fused

            self._fused = fused

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        # [..., 2 * d] -> [num_tokens, 2 * d] -> [..., d], one launch instead of three
        out = self._fused.silu_and_mul(x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], x.shape[-1] // 2)


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:], exact or with the tanh approximation."""

    def __init__(self, name: str = "gelu") -> None:
        super().__init__()
        self.approximate = _GELU_APPROX[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul_torch(x, self.approximate)


class Activation(nn.Module):
    """A plain activation by its config name."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = PLAIN_ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def gated_activation(name: str) -> nn.Module:
    """The gated form of activation ``name`` (checked with ``check_activation``)."""
    return SiluAndMul() if name in ("silu", "swish") else GeluAndMul(name)
