"""Kernel dispatch chosen once (vLLM's ``CustomOp``): a layer with a PyTorch
implementation (``forward_native``, in ``vllmpy.ops.native``) and a device one
(``forward_cuda``, Triton kernels in ``vllmpy.ops``) is bound to one of them when the model
is placed on its device (``bind_ops``), not by device checks inside ``forward``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CustomOp(nn.Module):
    """Subclasses define ``forward_native`` and, where a kernel pays, ``forward_cuda``; until
    ``bind_device`` runs, ``forward`` is the native one."""

    def __init__(self) -> None:
        super().__init__()
        self.on_cuda = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.on_cuda:
            return self.forward_cuda(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def bind_device(self, device: torch.device) -> None:
        """Choose the implementation for ``device`` (the kernels' modules load here)."""
        self.on_cuda = device.type == "cuda"


def bind_ops(model: nn.Module, device: torch.device) -> None:
    """Bind every ``CustomOp`` of ``model`` to ``device``'s implementation."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.bind_device(device)
