"""Linear layers, including the packed forms that fuse several checkpoint matrices.

Each packed layer owns one weight and knows where every checkpoint shard lands in it;
its ``weight_loader(param, loaded_weight, shard_id)`` copies one shard into place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _check_shape(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weight {name}: checkpoint shape {tuple(src.shape)} does not match the "
            f"model's {tuple(dst.shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    _check_shape(name, param, loaded)
    with torch.no_grad():
        param.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T (+ b), with W of shape [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several checkpoint matrices stacked along the output dimension.

    ``shards`` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its output size; the order of
    the mapping is the order of the rows.
    """

    def __init__(self, input_size: int, shards: dict[str | int, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shards.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shards.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: str | int, name: str = "") -> None:
        if shard_id not in self.shard_offsets:
            raise ValueError(f"weight {name}: unknown shard {shard_id!r}")
        offset, size = self.shard_offsets[shard_id]
        dst = param.narrow(0, offset, size)
        _check_shape(name, dst, loaded)
        with torch.no_grad():
            dst.copy_(loaded)
