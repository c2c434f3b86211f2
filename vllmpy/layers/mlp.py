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
        return self.down(self.gate_up_proj(x))  # [num_tokens, hidden_size]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) from gate_up_proj's output. A row the down projection
        streams takes one launch for both (``silu_mul_gemm``)."""
        down = self.down_proj
        if down.streams_one_row(gate_up):
            from vllmpy.ops.skinny_gemm import silu_mul_gemm

            return silu_mul_gemm(gate_up, down.weight, down.bias)  # type: ignore[arg-type]
        return down(self.act_fn(gate_up))
