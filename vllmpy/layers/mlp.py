"""The gated SiLU MLP of the Llama family: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.activation import SiluAndMul
from vllmpy.layers.linear import Linear, PackedLinear


class GatedMLP(nn.Module):
    """Parameters ``gate_up_proj`` (gate and up stacked, shard ids 0 and 1) and ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [num_tokens, hidden_size]
