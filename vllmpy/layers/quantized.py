"""GGUF block-quantized weights, and the CPU 4-bit matmul that runs them without
dequantizing.

GGUF stores a matrix row by row in blocks of 32 weights along the input dimension:

* ``Q4_0``: d (fp16), 16 bytes of 4-bit codes q;  w = d * (q - 8)
* ``Q4_1``: d (fp16), m (fp16), 16 bytes of codes; w = d * q + m
* ``Q8_0``: d (fp16), 32 int8 codes q;            w = d * q

In the 16 bytes of a 4-bit block, byte j holds q[j] in its low nibble and q[j + 16] in its
high one.

PyTorch's CPU 4-bit matmul (``aten._weight_int4pack_mm_for_cpu``) takes codes c in 0..15
in groups of 32 along the input dimension with w = (c - 8) * scale + zero, so Q4_0 maps to
scale d, zero 0 and Q4_1 to scale d, zero m + 8d, code for code. Scales and zeros are held
in the activation dtype (bfloat16): rounding d's 11-bit mantissa to 8 bits is the one
inexactness of the path. Q8_0 runs as two 4-bit passes (see ``Int4Weight``), which pays
only for a few tokens at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

BLOCK = 32  # weights per GGUF block (all types here), and the int4 kernel's group size
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANT_TYPES = frozenset(_BLOCK_BYTES)  # what QuantizedTensor carries
INT4_TYPES = frozenset({"Q4_0", "Q4_1"})  # what the 4-bit matmul runs in one pass
TWO_PASS_TYPES = frozenset({"Q8_0"})  # ... and in two passes (see Int4Weight)
INT4_DTYPES = frozenset({torch.bfloat16})  # activation dtypes it runs in
# The packing kernel works on blocks of output rows; it needs a multiple of this many.
INT4_ROW_MULTIPLE = 16


class QuantizedTensor(torch.Tensor):
    """One block-quantized matrix as a GGUF file stores it, in Hugging Face orientation.

    To everything that does not know about it, it is the dequantized [rows, cols] tensor of
    ``dtype``: any torch operation on it runs on ``dense()`` (so copying it into a
    parameter, ``.to()``, ``torch.equal`` all see the weights). A layer that knows reads
    ``quant_type`` and ``blocks`` instead and keeps the weight quantized.

    ``blocks`` is uint8 [rows, cols // 32 * bytes_per_block]: row r holds the blocks of
    output row r, so rows can be selected or permuted freely (``with_blocks``).
    """

    quant_type: str  # "Q4_0" | "Q4_1" | "Q8_0"
    blocks: torch.Tensor

    @staticmethod
    def __new__(cls, quant_type: str, shape: tuple[int, int], blocks: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> QuantizedTensor:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, shape, dtype=dtype, device=blocks.device)

    def __init__(self, quant_type: str, shape: tuple[int, int], blocks: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
        if quant_type not in _BLOCK_BYTES:
            raise ValueError(f"quantized tensor type {quant_type!r} is not supported; "
                             f"supported: {sorted(_BLOCK_BYTES)}")
        rows, cols = shape
        if cols % BLOCK != 0:
            raise ValueError(f"a {quant_type} tensor of shape {tuple(shape)} does not split "
                             f"into blocks of {BLOCK} along its {cols} columns")
        expected = (rows, cols // BLOCK * _BLOCK_BYTES[quant_type])
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != expected:
            raise ValueError(f"{quant_type} blocks of shape {tuple(shape)} must be uint8 "
                             f"{expected}; got {blocks.dtype} {tuple(blocks.shape)}")
        self.quant_type = quant_type
        self.blocks = blocks

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"QuantizedTensor({self.quant_type}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        def unwrap(t: object) -> object:
            return t.dense() if isinstance(t, QuantizedTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def with_blocks(self, blocks: torch.Tensor) -> QuantizedTensor:
        """The same type and dtype over other rows (``blocks`` [new_rows, bytes_per_row])."""
        return QuantizedTensor(self.quant_type, (blocks.shape[0], self.shape[1]), blocks,
                               self.dtype)

    def _split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes [rows, n_blocks, 32], d fp32 [rows, n_blocks, 1], m fp32 or None).

        Codes are uint8 0..15 for the 4-bit types and int8 for Q8_0."""
        rows, cols = tuple(self.shape)
        blk = self.blocks.view(rows, cols // BLOCK, _BLOCK_BYTES[self.quant_type])
        d = blk[..., 0:2].contiguous().view(torch.float16).float()
        if self.quant_type == "Q8_0":
            return blk[..., 2:].contiguous().view(torch.int8), d, None
        m = blk[..., 2:4].contiguous().view(torch.float16).float() \
            if self.quant_type == "Q4_1" else None
        nibbles = blk[..., -16:]
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
        return codes, d, m

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weights as a [rows, cols] ``dtype`` tensor, computed in float32 exactly as the
        ``gguf`` package (and llama.cpp) do, then rounded once to ``dtype`` (default: the
        tensor's own dtype)."""
        codes, d, m = self._split()
        if self.quant_type == "Q4_0":
            w = d * (codes.to(torch.int8) - 8).float()
        elif self.quant_type == "Q4_1":
            assert m is not None
            w = d * codes.float() + m
        else:
            w = codes.float() * d
        return w.reshape(tuple(self.shape)).to(dtype or self.dtype)


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


def _pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [rows, n_blocks, 32] in 0..15, scale and zero [rows, n_blocks, 1] -> one pass."""
    rows = codes.shape[0]
    packed = torch._convert_weight_to_int4pack_for_cpu(
        codes.reshape(rows, -1).to(torch.int32), 1)
    # [rows, n_blocks, 2] -> [n_blocks, rows, 2]
    scales_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).to(dtype).contiguous()
    return packed, scales_zeros


def pack_int4(qt: QuantizedTensor, dtype: torch.dtype) -> Int4Weight:
    """Repack a Q4_0, Q4_1 or Q8_0 tensor for the CPU 4-bit matmul, code for code."""
    if qt.quant_type not in INT4_TYPES | TWO_PASS_TYPES:
        raise ValueError(f"pack_int4 takes {sorted(INT4_TYPES | TWO_PASS_TYPES)}, "
                         f"not {qt.quant_type}")
    rows = qt.shape[0]
    if rows % INT4_ROW_MULTIPLE != 0:
        raise ValueError(f"pack_int4: {rows} output rows are not a multiple of "
                         f"{INT4_ROW_MULTIPLE}")
    codes, d, m = qt._split()
    if qt.quant_type == "Q8_0":
        hi = _pack((codes >> 4) + 8, 16 * d, torch.zeros_like(d), dtype)
        lo = _pack(codes & 0x0F, d, 8 * d, dtype)
        return Int4Weight((hi, lo), qt.quant_type)
    zero = 8 * d + m if m is not None else torch.zeros_like(d)
    return Int4Weight((_pack(codes, d, zero, dtype),), qt.quant_type)


def int4_linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [num_tokens, in_features] @ W^T -> [num_tokens, out_features], in x's dtype."""
    if not x.is_contiguous():
        x = x.contiguous()
    (packed, scales_zeros), *rest = weight.passes
    out = torch._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scales_zeros)
    for packed, scales_zeros in rest:
        out += torch._weight_int4pack_mm_for_cpu(x, packed, BLOCK, scales_zeros)
    return out
