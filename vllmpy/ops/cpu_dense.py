"""Dense float32 linear layers on the CPU through the C kernel ``f32_linear``
(``csrc/dense_f32.c``): the weight packed once into panels of 16 outputs (k-major, the
packed copy takes the dense one's place), every output one multiply-add chain over the
inputs in order. A row's output is the same whatever the call's row count, and the
kernel reads a panel once for up to 6 rows, so one routine serves a decode, a verify and
a prefill (docs/perf-log/cpu-decode.md, "float32 linear layers through packed panels").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllmpy.ops import cpu_kernels

# outputs a panel (the C source's NR)
PANEL = 16
# products of fewer multiply-adds than this run on one thread
SERIAL_MACS = 1 << 16


@dataclass(frozen=True)
class PackedF32:
    """A float32 weight [rows, cols] as ``f32_pack``'s panels."""

    rows: int
    cols: int
    panels: torch.Tensor  # float32 [ceil(rows / 16) * cols * 16]


def available() -> bool:
    return cpu_kernels.kernels() is not None


def pack(weight: torch.Tensor) -> PackedF32:
    """A 2-D float32 CPU weight (rows may be strided) as panels."""
    lib = cpu_kernels.kernels()
    assert lib is not None and weight.dtype == torch.float32 and weight.dim() == 2
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    rows, cols = weight.shape
    panels = torch.empty(-(-rows // PANEL) * cols * PANEL, dtype=torch.float32)
    lib.f32_pack(rows, cols, weight.data_ptr(), weight.stride(0), panels.data_ptr(),
                 torch.get_num_threads())
    return PackedF32(rows, cols, panels)


def linear(x: torch.Tensor, w: PackedF32, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for float32 ``x`` [..., cols]; into ``out`` (2-D [m, rows],
    rows contiguous) when given."""
    lib = cpu_kernels.kernels()
    assert lib is not None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.cols)
    if x2.stride(-1) != 1 or x2.dtype != torch.float32:
        x2 = x2.float().contiguous()
    m = x2.shape[0]
    target = out if out is not None else torch.empty(m, w.rows, dtype=torch.float32)
    assert target.dtype == torch.float32 and target.stride(-1) == 1
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    threads = 1 if m * w.rows * w.cols < SERIAL_MACS else torch.get_num_threads()
    lib.f32_linear(m, w.rows, w.cols, x2.data_ptr(), x2.stride(0), w.panels.data_ptr(),
                   None if bias is None else bias.data_ptr(), target.data_ptr(),
                   target.stride(0), threads)
    return target if out is not None else target.view(*lead, w.rows)
