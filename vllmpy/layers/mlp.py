"""The feed-forward blocks of decoder layers.

- ``GatedMLP``: ``down(act(gate(x)) * up(x))`` with gate and up packed (Llama, Qwen, Gemma,
  Phi-3, ...); SiLU or GELU gates.
- ``PlainMLP``: ``down(act(up(x)))`` with biases (GPT-2, OPT, GPT-NeoX, Starcoder2), its
  two projections under the checkpoint's own names.
"""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.activation import Activation, SiluAndMul, gated_activation
from vllmpy.layers.linear import Linear, PackedLinear


class GatedMLP(nn.Module):
    """Parameters ``gate_up_proj`` (gate and up stacked, shard ids 0 and 1) and ``down_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size},
                                         bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))  # [num_tokens, hidden_size]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(act(gate) * up) from gate_up_proj's output. A SiLU row the down
        projection streams takes one launch for both (``silu_mul_gemm``)."""
        down = self.down_proj
        if isinstance(self.act_fn, SiluAndMul) and down.streams_one_row(gate_up):
            return down._skinny.silu_mul_gemm(gate_up, down.weight,  # type: ignore[arg-type]
                                              down.bias, down.stream_scale)
        return down(self.act_fn(gate_up))


class PlainMLP(nn.Module):
    """``down(act(up(x)))``; ``names`` are the checkpoint's names of the up and down
    projections (``("c_fc", "c_proj")``, ``("dense_h_to_4h", "dense_4h_to_h")``, ...)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 bias: bool = True, names: tuple[str, str] = ("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, names[1], Linear(intermediate_size, hidden_size, bias=bias))
        self.act = Activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x)))
