"""Storage for a model built on the meta device."""

from __future__ import annotations

import torch
from torch import nn


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised
    storage on ``device``, the floating ones in ``dtype`` (what ``.to_empty(device=...)
    .to(dtype)`` gives, without a float32 copy on the device, and without to_empty's
    per-tensor cost of several ms on a meta tensor). Tied tensors stay tied. A parameter
    tagged ``keep_dtype`` (a quantization method's fp8 weight or fp32 scale) keeps its
    dtype, and every parameter keeps its tags."""
    # id of a meta tensor -> (the meta tensor, kept alive so its id stays its own; its
    # replacement)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def replace(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in made:
            keep = not t.is_floating_point() or getattr(t, "keep_dtype", False)
            new = torch.empty(t.shape, device=device, dtype=t.dtype if keep else dtype)
            if param:
                new = nn.Parameter(new, requires_grad=t.requires_grad)
                new.__dict__.update(t.__dict__)  # a quantization method's shard tags
            made[id(t)] = (t, new)
        return made[id(t)][1]

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = replace(p, True)  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = replace(b, False)
