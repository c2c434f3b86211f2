"""GGUF k-quant and Q8_0 weights on the CPU, run through PyTorch's 4-bit matmul without
dequantizing them at load.

``aten._weight_int4pack_mm_for_cpu`` multiplies by a matrix of 4-bit codes c (0..15) in
groups of 32 along the input dimension, each group of each output row with its own
(scale, zero): w = (c - 8) * scale + zero. The GGUF types below are written as a sum of
such matrices ("passes"), code for code:

* ``Q4_K``: super-blocks of 256 = 8 sub-blocks of 32, each with a 6-bit scale sc and
  6-bit min m under the super-block's fp16 d and dmin: w = d*sc*q - dmin*m, q in 0..15.
  One pass: c = q, scale = d*sc, zero = 8*d*sc - dmin*m.
* ``Q5_K``: as Q4_K with a fifth bit, q = lo + 16*hi in 0..31. Two passes: lo as Q4_K's
  one; c = hi + 8 with scale 16*d*sc and zero 0.
* ``Q8_0``: blocks of 32 int8 codes q under an fp16 d: w = d*q. Two passes with
  q = 16*hi + lo: c = hi + 8 (hi in -8..7) with scale 16*d, zero 0; c = lo (0..15) with
  scale d, zero 8*d.
* ``Q6_K``: super-blocks of 256 = 16 sub-blocks of 16, each with an int8 scale sc under
  the fp16 d: w = d*sc*(q - 32), q = lo + 16*hi in 0..63 (hi in 0..3). Its sub-blocks are
  half the kernel's groups, so it runs over a doubled input x' of 2 * cols: for each
  sub-block j, x'_j = [x_j, 16 * x_j] (32 values), and one pass of 2 * cols codes whose
  group j is [lo of sub-block j, hi + 6 of sub-block j] with s = d*sc_j and zero 8s/17.
  Element k of x_j then meets (lo - 8)*s + 8s/17 + 16 * ((hi - 2)*s + 8s/17)
  = (q - 40)*s + 8s = (q - 32)*s, its weight. The doubling costs one small copy of x.

Scales and zeros are held in the activation dtype, as the kernel requires. In float32
that is exact up to float32 rounding; in bfloat16 each scale and zero keeps 8 of its bits,
so a weight moves by at most 2**-9 * (|c - 8| * scale + |zero|) per pass (for Q6_K,
2**-9 * (|q - 40| + 8) * s <= 2**-9 * 48 * s in all). Q8_0's passes share one rounding of
d (16*d and 8*d are d times powers of two), so its weights move by at most 2**-9 * |w|, as
a dense bfloat16 copy's would.

With bfloat16 activations these beat the dense bfloat16 F.linear of the dequantized weight
at decode and lose at prefill (the kernel re-reads its weights every few tokens); with
float32 or float16 ones they lose at any batch, so ``supported`` takes bfloat16 only
(docs/perf-log/cpu-kquants.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # the kernel's group size along the input dimension
QK_K = 256  # weights per super-block of the k-quants
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34}  # bytes per GGUF block
BLOCK_WEIGHTS = {"Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "Q8_0": GROUP}  # weights per block
DOUBLED = frozenset({"Q6_K"})  # types that run over the doubled input (see the module doc)
# (quant type, activation dtype) pairs that beat the dense F.linear at decode.
SUPPORTED = frozenset({("Q4_K", torch.bfloat16), ("Q5_K", torch.bfloat16),
                       ("Q6_K", torch.bfloat16), ("Q8_0", torch.bfloat16)})
KERNEL_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})  # what it runs in
ROW_MULTIPLE = 16  # the packing kernel takes output rows in multiples of this
_PACK_ROWS = 4096  # rows packed at a time (a multiple of the kernel's 64-row tiles)


@dataclass(frozen=True)
class CpuQuantWeight:
    """A GGUF matrix [rows, cols] (Hugging Face orientation: out x in) packed for the CPU
    4-bit matmul, as one or more passes whose weights add up to the GGUF weights.

    Each pass is (packed, scales_zeros): uint8 [rows, width // 2] in the kernel's layout,
    and [width // 32, rows, 2] (scale, zero) in the activation dtype, where width is cols,
    or 2 * cols for a ``doubled`` weight (Q6_K), which ``linear`` gives the doubled input.
    """

    quant_type: str
    rows: int
    cols: int
    passes: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    doubled: bool = False  # the passes take the doubled input (2 * cols wide)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the weight runs in."""
        return self.passes[0][1].dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for p in self.passes for t in p)


def supported(quant_type: str, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether a ``quant_type`` matrix of [rows, cols] runs here with ``dtype`` activations
    faster than its dequantized copy would through ``F.linear``."""
    return ((quant_type, dtype) in SUPPORTED and rows % ROW_MULTIPLE == 0
            and cols % BLOCK_WEIGHTS[quant_type] == 0)


def pack(blocks: torch.Tensor, quant_type: str, rows: int, cols: int,
         dtype: torch.dtype) -> CpuQuantWeight:
    """Repack GGUF blocks (uint8 [rows, row_bytes], row r holding output row r's blocks in
    file order) for ``linear`` with ``dtype`` activations.

    Any type of ``BLOCK_BYTES`` packs, in any of ``KERNEL_DTYPES``, whether or not it is
    ``supported`` (faster than the dense path)."""
    if quant_type not in BLOCK_BYTES or dtype not in KERNEL_DTYPES:
        raise ValueError(f"cannot pack {quant_type} for {dtype} activations; types: "
                         f"{sorted(BLOCK_BYTES)}, dtypes: bfloat16, float16, float32")
    if rows % ROW_MULTIPLE or cols % BLOCK_WEIGHTS[quant_type]:
        raise ValueError(f"a {quant_type} matrix of [{rows}, {cols}] needs rows in "
                         f"multiples of {ROW_MULTIPLE} and columns in multiples of "
                         f"{BLOCK_WEIGHTS[quant_type]}")
    row_bytes = cols // BLOCK_WEIGHTS[quant_type] * BLOCK_BYTES[quant_type]
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (rows, row_bytes):
        raise ValueError(f"{quant_type} blocks of [{rows}, {cols}] must be uint8 "
                         f"[{rows}, {row_bytes}]; got {blocks.dtype} {tuple(blocks.shape)}")
    chunks = [_pack_rows(blocks[r:r + _PACK_ROWS], quant_type, dtype)
              for r in range(0, rows, _PACK_ROWS)]
    passes = tuple((torch.cat([c[i][0] for c in chunks]), torch.cat([c[i][1] for c in chunks], 1))
                   for i in range(len(chunks[0])))
    return CpuQuantWeight(quant_type, rows, cols, passes, quant_type in DOUBLED)


def linear(x: torch.Tensor, w: CpuQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols] @ W^T (+ bias) -> [..., rows], in x's dtype (which must be w.dtype)."""
    if x.dtype != w.dtype:
        raise TypeError(f"a weight packed for {w.dtype} activations got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.cols)
    if w.doubled:
        half = x2.reshape(-1, w.cols // 16, 1, 16)
        x2 = torch.cat([half, half * 16], dim=-2).reshape(-1, 2 * w.cols)
    elif not x2.is_contiguous():
        x2 = x2.contiguous()
    (packed, scales_zeros), *rest = w.passes
    out = torch._weight_int4pack_mm_for_cpu(x2, packed, GROUP, scales_zeros)
    for packed, scales_zeros in rest:
        out += torch._weight_int4pack_mm_for_cpu(x2, packed, GROUP, scales_zeros)
    if bias is not None:
        out += bias
    return out.reshape(*lead, w.rows)


# ---- unpacking GGUF blocks into passes --------------------------------------------------

def _pack_rows(blocks: torch.Tensor, quant_type: str,
               dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pack some rows of blocks: one (packed, scales_zeros) per pass."""
    rows = blocks.shape[0]
    planes = _PLANES[quant_type](blocks.view(rows, -1, BLOCK_BYTES[quant_type]))
    out = []
    for codes, scale, zero in planes:
        packed = torch._convert_weight_to_int4pack_for_cpu(
            codes.reshape(rows, -1).to(torch.int32), 1)
        # [rows, groups] twice -> [groups, rows, 2]
        scales_zeros = torch.stack([scale.reshape(rows, -1), zero.reshape(rows, -1)], -1)
        out.append((packed, scales_zeros.transpose(0, 1).to(dtype).contiguous()))
    return out


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at bytes [at, at + 2) of each block, as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 4 * 32] bytes of a k-quant -> [..., 8, 32] codes: each run of 32 bytes holds
    one sub-block in its low nibbles and the next in its high ones."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([q & 0x0F, q >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (d * sc, dmin * m), float32 [rows, blocks, 8, 1].

    The 12 scale bytes hold eight 6-bit scales and eight 6-bit mins: bytes 0-3 and 4-7 give
    the low 6 bits of scales 0-3 and mins 0-3, bytes 8-11 the low 4 bits of scales 4-7
    (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top 2 bits of bytes
    0-3 and 4-7."""
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return ((_f16(b, 0) * sc.float()).unsqueeze(-1),
            (_f16(b, 2) * m.float()).unsqueeze(-1))


_Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, scale, zero


def _q4_k(b: torch.Tensor) -> list[_Plane]:
    scale, dm = _k_scales(b)
    return [(_nibbles(b[..., 16:144]), scale, 8 * scale - dm)]


def _q5_k(b: torch.Tensor) -> list[_Plane]:
    scale, dm = _k_scales(b)
    # Byte l of qh holds, in bit j, the fifth bit of element l of sub-block j.
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    hi = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1
    return [(_nibbles(b[..., 48:176]), scale, 8 * scale - dm),
            (hi + 8, 16 * scale, torch.zeros_like(scale))]


def _q8_0(b: torch.Tensor) -> list[_Plane]:
    d = _f16(b, 0)
    q = b[..., 2:34].contiguous().view(torch.int8)
    return [(((q >> 4) + 8).to(torch.uint8), 16 * d, torch.zeros_like(d)),
            ((q & 0x0F).to(torch.uint8), d, 8 * d)]


def _q6_k(b: torch.Tensor) -> list[_Plane]:
    """Q6_K over the doubled input: each 16-wide sub-block j becomes one group of 32
    codes, its 16 low nibbles (against x_j) then its 16 high 2-bit parts + 6 (against
    16 * x_j), with scale s = d * sc_j and zero 8s/17 (see the module doc)."""
    rows = b.shape[0]
    # Per half of 128: bytes 0-63 of ql give elements 0-63 (low nibbles) and 64-127
    # (high nibbles); byte l of qh gives, in bits 2i..2i+1, the high part of element
    # 32i + l.
    ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(rows, -1, 16, 1, 16)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    hi = ((qh >> shifts) & 3).reshape(rows, -1, 16, 1, 16)
    scale = _f16(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()
    return [(torch.cat([lo, hi + 6], dim=-2), scale, scale * (8 / 17))]


_PLANES = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q8_0": _q8_0}
