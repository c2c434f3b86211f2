"""PyTorch's CPU 4-bit matmul over GGUF Q4_0 / Q4_1 / Q8_0 blocks, code for code.

GGUF stores a matrix row by row in blocks of 32 weights along the input dimension:

* ``Q4_0``: d (fp16), 16 bytes of 4-bit codes q;  w = d * (q - 8)
* ``Q4_1``: d (fp16), m (fp16), 16 bytes of codes; w = d * q + m
* ``Q8_0``: d (fp16), 32 int8 codes q;            w = d * q

In the 16 bytes of a 4-bit block, byte j holds q[j] in its low nibble and q[j + 16] in its
high one.

``aten._weight_int4pack_mm_for_cpu`` takes codes c in 0..15 in groups of 32 along the input
dimension with w = (c - 8) * scale + zero, so Q4_0 maps to scale d, zero 0 and Q4_1 to
scale d, zero m + 8d, code for code. Scales and zeros are held in the activation dtype
(bfloat16): rounding d's 11-bit mantissa to 8 bits is the one inexactness of the path.
Q8_0 runs as two 4-bit passes (see ``Int4Weight``), which pays only for a few tokens at a
time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block of these types, and the kernel's group size
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
INT4_TYPES = frozenset({"Q4_0", "Q4_1"})  # what the 4-bit matmul runs in one pass
TWO_PASS_TYPES = frozenset({"Q8_0"})  # ... and in two passes (see Int4Weight)
INT4_DTYPES = frozenset({torch.bfloat16})  # activation dtypes it runs in
# The packing kernel works on blocks of output rows; it needs a multiple of this many.
INT4_ROW_MULTIPLE = 16


@dataclass(frozen=True)
class Int4Weight:
    """A weight packed for ``aten._weight_int4pack_mm_for_cpu``: one or two passes.

    Each pass is (packed, scales_zeros): uint8 [out_features, in_features // 2] in the
    kernel's own layout, and [in_features // 32, out_features, 2] (scale, zero) in the
    activation dtype, with w = (code - 8) * scale + zero. The weight is the sum of the
    passes: Q4_0 and Q4_1 take one; Q8_0 takes two, its int8 codes q split as
    q = 16 * hi + lo (hi in -8..7 with scale 16d, lo in 0..15 with scale d and zero 8d).
    """

    passes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    quant_type: str  # the GGUF type it came from

    @property
    def dtype(self) -> torch.dtype:
        return self.passes[0][1].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.passes for t in p)


def int4_supported(quant_type: str, rows: int, device: torch.device,
                   dtype: torch.dtype, two_pass: bool = False) -> bool:
    """Whether a ``quant_type`` matrix of ``rows`` output rows can run as an ``Int4Weight``
    with ``dtype`` activations on ``device``; Q8_0 (two passes) only if ``two_pass``."""
    types = INT4_TYPES | TWO_PASS_TYPES if two_pass else INT4_TYPES
    return (device.type == "cpu" and dtype in INT4_DTYPES and quant_type in types
            and rows % INT4_ROW_MULTIPLE == 0)


def split_blocks(blocks: torch.Tensor, quant_type: str, cols: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes [rows, n_blocks, 32], d fp32 [rows, n_blocks, 1], m fp32 or None) of
    Q4_0 / Q4_1 / Q8_0 blocks [rows, row_bytes]. Codes are uint8 0..15 for the 4-bit
    types and int8 for Q8_0."""
    rows = blocks.shape[0]
    blk = blocks.view(rows, cols // BLOCK, BLOCK_BYTES[quant_type])
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    if quant_type == "Q8_0":
        return blk[..., 2:].contiguous().view(torch.int8), d, None
    m = blk[..., 2:4].contiguous().view(torch.float16).float() \
        if quant_type == "Q4_1" else None
    nibbles = blk[..., -16:]
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1), d, m


def _pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [rows, n_blocks, 32] in 0..15, scale and zero [rows, n_blocks, 1] -> one pass."""
    rows = codes.shape[0]
    packed = torch._convert_weight_to_int4pack_for_cpu(
        codes.reshape(rows, -1).to(torch.int32), 1)
    # [rows, n_blocks, 2] -> [n_blocks, rows, 2]
    scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
    return packed, scales_zeros


def pack_int4(blocks: torch.Tensor, quant_type: str, cols: int,
              dtype: torch.dtype) -> Int4Weight:
    """Repack Q4_0, Q4_1 or Q8_0 blocks [rows, row_bytes] for the CPU 4-bit matmul."""
    if quant_type not in INT4_TYPES | TWO_PASS_TYPES:
        raise ValueError(f"pack_int4 takes {sorted(INT4_TYPES | TWO_PASS_TYPES)}, "
                         f"not {quant_type}")
    rows = blocks.shape[0]
    if rows % INT4_ROW_MULTIPLE != 0:
        raise ValueError(f"pack_int4: {rows} output rows are not a multiple of "
                         f"{INT4_ROW_MULTIPLE}")
    codes, d, m = split_blocks(blocks, quant_type, cols)
    if quant_type == "Q8_0":
        hi = _pack((codes >> 4) + 8, 16 * d, torch.zeros_like(d), dtype)
        lo = _pack(codes & 0x0F, d, 8 * d, dtype)
        return Int4Weight((hi, lo), quant_type)
    zero = 8 * d + m if m is not None else torch.zeros_like(d)
    return Int4Weight((_pack(codes, d, zero, dtype),), quant_type)


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [num_tokens, in_features] @ W^T -> [num_tokens, out_features], in x's dtype."""
    if not x.is_contiguous():
        x = x.contiguous()
    (packed, scales_zeros), *rest = weight.passes
    out = torch._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scales_zeros)
    for packed, scales_zeros in rest:
        out += torch._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scales_zeros)
    return out
