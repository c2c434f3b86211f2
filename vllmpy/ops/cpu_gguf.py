"""GGUF weights kept in their blocks on the CPU, multiplied by the C kernel
``gguf_linear`` (``csrc/gguf_blocks.c``): what a float32 model (the CPU default) and the
types PyTorch's 4-bit kernels do not take run on (``layers/quantization/gguf.py``; in
bfloat16 those kernels decode the 4-bit types a little faster on the machines measured,
docs/perf-log/cpu-decode.md).

Each output row's blocks are decoded to float32 inside the kernel and multiplied with the
activation rows in float32, so a layer reads its blocks (4.5-8.5 bits a weight) instead of
a dense copy, in any activation dtype: the products are those of the weights gguf-py's
``dequantize`` gives, summed in another order. Steps of more than ``MAX_KERNEL_ROWS``
rows (prefills) decode the matrix into a transient float32 copy and take PyTorch's
float32 matmul, whose large-row rate the kernel does not reach (and which, unlike a
bfloat16 one, every CPU runs at its vector rate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllmpy.ops import cpu_kernels

# the kernel's block-type codes (csrc/gguf_blocks.c)
# (BF16: a dense bfloat16 row read as 32-weight "blocks", for CPUs without bfloat16 units)
QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5,
               "Q5_K": 6, "Q6_K": 7, "BF16": 8}
# weights per block of each type (the rows' length must be a multiple)
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 256,
                 "Q5_K": 256, "Q6_K": 256, "BF16": 32}
# Steps of more rows than this decode a transient dense copy and take PyTorch's matmul
# (docs/perf-log/cpu-decode.md, "GGUF blocks on the CPU")
MAX_KERNEL_ROWS = 16


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF matrix [rows, cols] (Hugging Face orientation) as its blocks: ``blocks``
    uint8 [rows, bytes per row], contiguous."""

    quant_type: str
    rows: int
    cols: int
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def supported(quant_type: str, cols: int, device: torch.device) -> bool:
    """Whether the kernel runs this type of matrix here (a CPU with the C kernels built)."""
    return (device.type == "cpu" and quant_type in QTYPE_CODES
            and cols % BLOCK_WEIGHTS[quant_type] == 0 and cpu_kernels.kernels() is not None)


def make(blocks: torch.Tensor, quant_type: str, rows: int, cols: int) -> BlockWeight:
    return BlockWeight(quant_type, rows, cols, blocks.contiguous())


def linear(x: torch.Tensor, w: BlockWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for 2-D ``x`` [m, cols] (float32, bfloat16 or float16), in x's dtype;
    into ``out`` [m, rows] (rows contiguous) when given."""
    m = x.shape[0]
    if m > MAX_KERNEL_ROWS:  # in float32: a CPU without bfloat16 units multiplies it slowly
        y = F.linear(x.float(), dequantize(w, torch.float32))
        return y.to(x.dtype) if out is None else out.copy_(y)
    lib = cpu_kernels.kernels()
    assert lib is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty(m, w.rows, dtype=x.dtype)
    assert out.stride(-1) == 1 and out.dtype in cpu_kernels.DTYPE_CODES
    threads = 1 if w.blocks.numel() * max(m, 1) < cpu_kernels.SERIAL_ELEMENTS else \
        torch.get_num_threads()
    lib.gguf_linear(m, w.rows, w.cols, x.data_ptr(), x.stride(0),
                    cpu_kernels.DTYPE_CODES[x.dtype], w.blocks.data_ptr(), w.blocks.stride(0),
                    QTYPE_CODES[w.quant_type], out.data_ptr(), out.stride(0),
                    cpu_kernels.DTYPE_CODES[out.dtype], threads)
    return out


def bf16_rows(weight: torch.Tensor) -> BlockWeight:
    """A contiguous bfloat16 [rows, cols] weight as the kernel's BF16 blocks (no copy)."""
    return BlockWeight("BF16", weight.shape[0], weight.shape[1], weight.view(torch.uint8))


def dequantize(w: BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weights as a dense [rows, cols] tensor of ``dtype``."""
    lib = cpu_kernels.kernels()
    assert lib is not None
    out = torch.empty(w.rows, w.cols, dtype=dtype)
    lib.gguf_dequantize(w.rows, w.cols, w.blocks.data_ptr(), w.blocks.stride(0),
                        QTYPE_CODES[w.quant_type], out.data_ptr(),
                        cpu_kernels.DTYPE_CODES[dtype], torch.get_num_threads())
    return out
