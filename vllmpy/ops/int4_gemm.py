"""W4A16 linear layers: group-wise int4 weights, 16- or 32-bit activations.

Semantics
---------
A weight [N, K] is stored as 4-bit codes 0..15 with, per row and per group of ``group``
consecutive columns, a scale and a zero code: ``w[n, k] = (code[n, k] - zero[n, k //
group]) * scale[n, k // group]``. Symmetric weights have no zeros (zero = 8). A group of
-1 means one group per row (channel-wise), stored as group = K.

Layout (``Int4Packed``)
-----------------------
- ``qweight`` uint8 [H, K], H = ceil(N / 2): byte (j, k) holds row j's code in its low
  nibble and row j + H's in its high nibble (a high nibble past N is 0). Each byte row
  is contiguous along K, so one pass along K streams two weight rows, and a tile of byte
  rows [j0, j0 + b) dequantizes into the output columns [j0, j0 + b) and
  [H + j0, H + j0 + b): two contiguous ranges, and the activation tile is used as it
  is.
- ``scales`` [N, K // group] in the dtype given (float16, bfloat16 or float32).
- ``zeros`` uint8 [N, K // group] codes, or None for symmetric weights.

That is N * K / 2 bytes of codes plus the scales and zeros; no dense copy is kept.

Kernels
-------
Codes become floats without an integer-to-float conversion: OR-ing a nibble into the
mantissa of 2^23 gives the float 2^23 + code (2^23 + 16 * code for a high nibble left in
place), and subtracting 2^23 + zero (2^23 + 16 * zero) leaves the exact integer
code - zero (16 times it, whose 1/16 goes into the scale).

- ``int4_linear`` with one float16 or bfloat16 row: the packed GEMV. A 32-bit word of a
  byte row holds 4 columns of two weight rows; one lop3 makes an f16x2 pair of
  1024 + code from two nibbles (the 0x6400 float16 exponent), sub.f16x2 takes the zero
  away and fma.f16x2 multiplies by the activations, which are first scaled per tile by
  a power of two into [1, 2) so no float16 sum can overflow; each instance of the
  inline PTX sums 8 columns of both rows and returns them as fp32, and the group scale
  and the tile's power of two are applied to that fp32 sum. The next chunk's words
  load while one is summed. About 7.5 instructions a byte of codes where the fp32 GEMV
  spends 15.6 (sm_90, 8 byte rows a program); under Triton's interpreter the same sums run in fp32 from the
  same packed operands.
- one float32 row (or K not a multiple of 4): the fp32 GEMV. Each program owns a few byte
  rows, walks K in chunks of whole groups held as [rows, groups, group] tiles, sums the
  exact fp32 products per group and applies each group's scale once.
- Both stream the packed weight once, splitting K when N gives too few programs.
- more rows: a dequantizing GEMM. Each K tile (inside one group) of byte rows is turned
  into two [b, BLOCK_K] tiles of x's dtype, (code - zero) * scale, and ``tl.dot`` adds
  x_tile @ tile.T into the two output ranges' accumulators (fp32; float32 activations
  use IEEE fp32 dots, not TF32). Up to 16 rows take one row tile, so the weight is read
  and dequantized once.

The one-row kernels still read well under HBM bandwidth: the packed GEMV is bound by the
bytes in flight per multiprocessor, the fp32 one by instruction issue
(docs/perf-log/int4-gemv.md).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.paged_attention import num_multiprocessors
from vllmpy.ops.pdl import pdl_args, pdl_wait

# The fp32 one-row GEMV (float32 activations): GEMV_BLOCK_J byte rows (twice as many weight rows) a program, walked
# in GEMV_CHUNK-wide chunks on GEMV_WARPS warps: 4 KiB of codes a chunk, and Qwen3-8B's
# projections (N >= 4,096) run at least 512 programs. Compiled for sm_90 its loop issues
# about 15 instructions per byte of codes (7.5 a weight: extracting, widening,
# subtracting the zero, multiplying, summing), so on an H200 it is bound by issue, not
# by memory, well below HBM bandwidth; see ``int4_linear``.
GEMV_BLOCK_J = 4
GEMV_CHUNK = 1024
GEMV_WARPS = 4
# A GEMV splits K when it would otherwise run fewer programs than this many per
# multiprocessor (splitting costs two more launches: zeroing the fp32 output and
# rounding it).
GEMV_MIN_PROGRAMS_PER_SM = 1
# The packed f16x2 GEMV (16-bit activations): F16X2_BLOCK_J byte rows a program, chunks
# of F16X2_CHUNK columns in tiles of at most F16X2_SUB (inside one scale group); the
# fastest of the launch configurations swept (docs/perf-log/int4-gemv.md).
F16X2_BLOCK_J = 8
F16X2_CHUNK = 1024
F16X2_SUB = 128
F16X2_WARPS = 4
SYMMETRIC_ZERO = 8
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23
_TWO_23 = tl.constexpr(8388608.0)
_SYMMETRIC_ZERO = tl.constexpr(float(SYMMETRIC_ZERO))


@dataclasses.dataclass(frozen=True)
class Int4Packed:
    """A group-wise int4 weight in the layout of the module docstring: ``qweight`` uint8
    [ceil(N / 2), K], ``scales`` [N, K // group], ``zeros`` uint8 [N, K // group] or None
    (symmetric, zero 8), ``group`` (K for channel-wise), and the logical shape N x K."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    N: int
    K: int

    @property
    def nbytes(self) -> int:
        """Bytes stored: codes, scales and zeros."""
        total = self.qweight.numel() + self.scales.numel() * self.scales.element_size()
        return total + (self.zeros.numel() if self.zeros is not None else 0)


def _group_size(group: int, k: int) -> int:
    if group == -1:
        return k
    if group < 1 or k % group:
        raise ValueError(f"the group size must divide K = {k} (or be -1), got {group}")
    if group != k and (group < 16 or group & (group - 1)):
        raise ValueError(f"a group smaller than K must be a power of two >= 16, got {group}")
    return group


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              group: int) -> Int4Packed:
    """Pack int4 codes [N, K] (any integer dtype, values 0..15) with their scales
    [N, K // group] (float16, bfloat16 or float32) and zero codes [N, K // group] (values
    0..15; None for symmetric weights, zero 8) into an ``Int4Packed``, on the codes'
    device. ``group`` divides K (a power of two >= 16), or is -1 or K for one group per
    row. The scales keep their dtype; checking the code ranges reads them back to the
    host once."""
    if codes.dim() != 2 or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer [N, K], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    n, k = codes.shape
    group = _group_size(group, k)
    n_groups = k // group
    if scales.dtype not in SCALE_DTYPES or tuple(scales.shape) != (n, n_groups):
        raise ValueError(f"scales must be float16, bfloat16 or float32 [{n}, {n_groups}], "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    check_same_device("scales", scales, codes, "codes")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("codes must lie in 0..15")
    if zeros is not None:
        if zeros.dtype.is_floating_point or tuple(zeros.shape) != (n, n_groups):
            raise ValueError(f"zeros must be integer codes [{n}, {n_groups}], got "
                             f"{zeros.dtype} {tuple(zeros.shape)}")
        check_same_device("zeros", zeros, codes, "codes")
        if zeros.numel() and (int(zeros.min()) < 0 or int(zeros.max()) > 15):
            raise ValueError("zeros must lie in 0..15")
        zeros = zeros.to(torch.uint8).contiguous()
    h = (n + 1) // 2
    c = codes.to(torch.uint8)
    high = torch.zeros((h, k), dtype=torch.uint8, device=codes.device)
    high[: n - h] = c[h:]
    qweight = (c[:h] | (high << 4)).contiguous()
    return Int4Packed(qweight, scales.contiguous(), zeros, group, n, k)


def unpack_int4_codes(w: Int4Packed) -> torch.Tensor:
    """The uint8 codes [N, K] of a packed weight."""
    return torch.cat([w.qweight & 0xF, w.qweight >> 4])[: w.N]


def dequantize_int4(w: Int4Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight, ``(code - zero) * scale`` computed in fp32 and rounded
    once to ``dtype``."""
    codes = unpack_int4_codes(w).float()
    if w.zeros is not None:
        zeros = w.zeros.float()
    else:
        zeros = torch.full_like(w.scales, SYMMETRIC_ZERO, dtype=torch.float32)
    scale = w.scales.float().repeat_interleave(w.group, 1)
    return ((codes - zeros.repeat_interleave(w.group, 1)) * scale).to(dtype)


def int4_linear_ref(x: torch.Tensor, w: Int4Packed,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference for ``int4_linear``: the weight dequantized to x's dtype, then
    ``F.linear``."""
    return F.linear(x, dequantize_int4(w, x.dtype), bias)


# ---- kernels ---------------------------------------------------------------------------

@triton.jit
def _low_nibbles(b, zero):
    # code - zero of the low nibbles of the int32-widened bytes b, as exact fp32 (zero
    # broadcasts against b)
    return ((b & 0xF) | _MAGIC).to(tl.float32, bitcast=True) - (zero + _TWO_23)


@triton.jit
def _high_nibbles(b, zero):
    # 16 * (code - zero) of the high nibbles, left in place, as exact fp32
    return ((b & 0xF0) | _MAGIC).to(tl.float32, bitcast=True) - (16.0 * zero + _TWO_23)


@triton.jit
def _group_params(s_ptr, z_ptr, rows, row_ok, gi, g_ok, n_groups, HAS_ZEROS: tl.constexpr):
    # the fp32 scales and zeros [R, G] of weight rows `rows` [R] in groups `gi` [G]
    idx = rows[:, None] * n_groups + gi[None, :]
    ok = row_ok[:, None] & g_ok[None, :]
    scale = tl.load(s_ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + idx, mask=ok, other=0).to(tl.float32)
    else:
        zero = tl.zeros_like(scale) + _SYMMETRIC_ZERO
    return scale, zero


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, K, H, n_groups,
                      group, k_per_split, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_J: tl.constexpr, GROUPS: tl.constexpr,
                      SUB: tl.constexpr, PDL: tl.constexpr):
    # out[n] = sum_k x[k] * w[n, k] for one row x. Program (i, s) owns byte rows
    # [i * BLOCK_J, (i + 1) * BLOCK_J), i.e. weight rows j and j + H, and the K range
    # [s * k_per_split, (s + 1) * k_per_split), in chunks of GROUPS x SUB columns (SUB:
    # the group, or the chunk when one group spans several chunks), each group's
    # products summed before its scale multiplies them; with SPLIT the partial sums are
    # added atomically into a zeroed fp32 output.
    pid_j = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = offs_j < H
    rows_hi = offs_j + H
    hi_ok = rows_hi < N
    offs_g = tl.arange(0, GROUPS)
    offs_s = tl.arange(0, SUB)
    q_rows = q_ptr + offs_j[:, None, None].to(tl.int64) * K
    pdl_wait(PDL)
    acc_lo = tl.zeros((BLOCK_J,), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_J,), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), GROUPS * SUB):
        kk = k0 + offs_g[:, None] * SUB + offs_s[None, :]  # [GROUPS, SUB]
        k_ok = kk < K
        b = tl.load(q_rows + kk[None, :, :], mask=j_ok[:, None, None] & k_ok[None, :, :],
                    other=0).to(tl.int32)
        gi = (k0 + offs_g * SUB) // group
        g_ok = gi < n_groups
        s_lo, z_lo = _group_params(s_ptr, z_ptr, offs_j, j_ok, gi, g_ok, n_groups,
                                   HAS_ZEROS)
        s_hi, z_hi = _group_params(s_ptr, z_ptr, rows_hi, hi_ok, gi, g_ok, n_groups,
                                   HAS_ZEROS)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        acc_lo += tl.sum(tl.sum(_low_nibbles(b, z_lo[:, :, None]) * x, axis=2) * s_lo, axis=1)
        # the high nibbles' values are 16 * (code - zero); 1/16 goes into the scale
        acc_hi += tl.sum(tl.sum(_high_nibbles(b, z_hi[:, :, None]) * x, axis=2)
                         * (s_hi * 0.0625), axis=1)
    if HAS_BIAS:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid_k == 0:
            acc_lo += tl.load(bias_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)
            acc_hi += tl.load(bias_ptr + rows_hi, mask=hi_ok, other=0.0).to(tl.float32)
    if SPLIT:
        tl.atomic_add(out_ptr + offs_j, acc_lo, mask=j_ok)
        tl.atomic_add(out_ptr + rows_hi, acc_hi, mask=hi_ok)
    else:
        tl.store(out_ptr + offs_j, acc_lo.to(out_ptr.dtype.element_ty), mask=j_ok)
        tl.store(out_ptr + rows_hi, acc_hi.to(out_ptr.dtype.element_ty), mask=hi_ok)


# The packed one-row path: a 32-bit word of codes (byte row j at columns k .. k + 3) holds
# row j's codes in nibbles 0, 2, 4, 6 and row j + H's in nibbles 1, 3, 5, 7. One lop3 turns
# two nibbles into an f16x2 pair of 1024 + code (a low nibble) or 1024 + 16 * code (a high
# one), one sub.f16x2 takes away the zero, and one fma.f16x2 multiplies the pair by the
# activations of its columns: about 2.5 instructions a byte where the fp32 GEMV spends 15.
# Each instance takes two words (8 columns), keeps the products of each row in one f16x2
# sum (4 terms a half) and returns the two rows' fp32 sums.
_PAIR_SUMS_ASM = tl.constexpr("""
{
.reg .b32 t, v0, v1, v2, v3, lo, hi;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
lop3.b32 v0, $2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v1, $2, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $2, 8;
lop3.b32 v2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v3, t, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 v0, v0, $8;
sub.f16x2 v1, v1, $9;
sub.f16x2 v2, v2, $8;
sub.f16x2 v3, v3, $9;
mul.f16x2 lo, v0, $4;
fma.rn.f16x2 lo, v2, $5, lo;
mul.f16x2 hi, v1, $4;
fma.rn.f16x2 hi, v3, $5, hi;
lop3.b32 v0, $3, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v1, $3, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, $3, 8;
lop3.b32 v2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 v3, t, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 v0, v0, $8;
sub.f16x2 v1, v1, $9;
sub.f16x2 v2, v2, $8;
sub.f16x2 v3, v3, $9;
fma.rn.f16x2 lo, v0, $6, lo;
fma.rn.f16x2 lo, v2, $7, lo;
fma.rn.f16x2 hi, v1, $6, hi;
fma.rn.f16x2 hi, v3, $7, hi;
mov.b32 {h0, h1}, lo;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 f0, f0, f1;
mov.b32 $0, f0;
mov.b32 {h0, h1}, hi;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 f0, f0, f1;
mov.b32 $1, f0;
}
""")


@triton.jit
def _half(pair, upper: tl.constexpr):
    # one float16 of an f16x2 pair held in an int32, as fp32
    bits = (pair >> 16) if upper else pair
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_terms(w, x02, x13, zero, first: tl.constexpr):
    # the emulated asm for one word and one row: first picks row j's nibbles (0, 2, 4, 6)
    # over row j + H's (1, 3, 5, 7, valued 16 * code like the asm's high pairs)
    shift = 0 if first else 4
    mult = 1.0 if first else 16.0
    total = (((w >> shift) & 0xF).to(tl.float32) * mult - zero) * _half(x02, False)
    total += (((w >> (shift + 16)) & 0xF).to(tl.float32) * mult - zero) * _half(x02, True)
    total += (((w >> (shift + 8)) & 0xF).to(tl.float32) * mult - zero) * _half(x13, False)
    total += (((w >> (shift + 24)) & 0xF).to(tl.float32) * mult - zero) * _half(x13, True)
    return total


@triton.jit
def _pair_sums(wa, wb, xa02, xa13, xb02, xb13, z1, z16, USE_ASM: tl.constexpr):
    # (row j's sum, 16 x row j + H's sum) of the 8 columns of words wa and wb: the asm on
    # a GPU, the same sums in fp32 under the interpreter
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _PAIR_SUMS_ASM, "=r,=r,r,r,r,r,r,r,r,r",
            [wa, wb, xa02, xa13, xb02, xb13, z1, z16],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
    z_lo = ((z1 & 0xFFFF) - 0x6400).to(tl.float32)
    z_hi = ((z16 & 0xFFFF) - 0x6400).to(tl.float32)
    lo = _nibble_terms(wa, xa02, xa13, z_lo, True) + _nibble_terms(wb, xb02, xb13, z_lo, True)
    hi = (_nibble_terms(wa, xa02, xa13, z_hi, False)
          + _nibble_terms(wb, xb02, xb13, z_hi, False))
    return lo, hi


@triton.jit
def _f16x2_chunk(q_rows, x_ptr, wa_at, j_ok, end, HALF: tl.constexpr):
    # one chunk's words [BLOCK_J, GROUPS, HALF] of the tiles' two halves (word indices
    # wa_at and wa_at + HALF) and their activations as fp32 [GROUPS, HALF, 4], one
    # contiguous load a thread; words from `end` on (the K range's end) read as zeros
    wb_at = wa_at + HALF
    a_ok = wa_at < end
    b_ok = wb_at < end
    wa = tl.load(q_rows + wa_at[None, :, :], mask=j_ok[:, None, None] & a_ok[None], other=0)
    wb = tl.load(q_rows + wb_at[None, :, :], mask=j_ok[:, None, None] & b_ok[None], other=0)
    four = tl.arange(0, 4)[None, None, :]
    xa = tl.load(x_ptr + wa_at[:, :, None] * 4 + four, mask=a_ok[:, :, None],
                 other=0.0).to(tl.float32)
    xb = tl.load(x_ptr + wb_at[:, :, None] * 4 + four, mask=b_ok[:, :, None],
                 other=0.0).to(tl.float32)
    return wa, wb, xa, xb


@triton.jit
def _x_pairs(x, scale):
    # the f16x2 pairs (x[k], x[k + 2]) and (x[k + 1], x[k + 3]) of the words of x
    # [G, W, 4] (fp32, times the power of two `scale` [G, 1, 1] before rounding)
    bits = (x * scale).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    even, odd = tl.split(tl.reshape(bits, (bits.shape[0], bits.shape[1], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0 | (c2 << 16), c1 | (c3 << 16)


@triton.jit
def _int4_gemv_f16x2_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, K, KW, H,
                            n_groups, group, k_per_split, HAS_ZEROS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                            BLOCK_J: tl.constexpr, GROUPS: tl.constexpr,
                            SUB: tl.constexpr, USE_ASM: tl.constexpr, PDL: tl.constexpr):
    # out[n] = sum_k x[k] * w[n, k] for one float16 or bfloat16 row x, over the packed
    # words (KW = K / 4 a byte row). Program (i, s) owns byte rows [i * BLOCK_J, (i + 1) *
    # BLOCK_J) (weight rows j and j + H) and the K range [s * k_per_split, (s + 1) *
    # k_per_split), in chunks of GROUPS tiles of SUB columns inside one scale group. A
    # tile's words are taken in two halves, (wa, wb) pairs from its first and second half.
    # Each tile's activations are scaled by a power of two that brings their largest
    # magnitude into [1, 2) before they become float16 (the f16x2 sums stay far from
    # overflow); the fp32 sums are scaled back with the group's scale and summed over the
    # tile's words once, after the last chunk.
    HALF: tl.constexpr = SUB // 8  # words in half a tile
    pid_j = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = offs_j < H
    rows_hi = offs_j + H
    hi_ok = rows_hi < N
    offs_g = tl.arange(0, GROUPS)
    offs_w = tl.arange(0, HALF)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32)) + offs_j[:, None, None].to(tl.int64) * KW
    pdl_wait(PDL)
    acc_lo = tl.zeros((BLOCK_J, GROUPS, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_J, GROUPS, HALF), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # [GROUPS, HALF] word indices (a word: 4 columns) of the first chunk's first halves;
    # k_start is a multiple of the chunk (at least 16 columns), so the words are 16-byte
    # aligned
    wa_at = (tl.multiple_of(k_start // 4, 4) + offs_g[:, None] * (SUB // 4)
             + offs_w[None, :])
    wa, wb, xa, xb = _f16x2_chunk(q_rows, x_ptr, wa_at, j_ok, k_end // 4, HALF)
    for k0 in range(k_start, k_end, GROUPS * SUB):
        # the next chunk's words and activations load while this one is summed
        next_at = wa_at + GROUPS * SUB // 4
        wa_n, wb_n, xa_n, xb_n = _f16x2_chunk(q_rows, x_ptr, next_at, j_ok, k_end // 4, HALF)
        # 2^-e and 2^e for the exponent e of each tile's largest |x| (its fp32 bits)
        big = tl.maximum(tl.max(tl.max(tl.abs(xa), axis=2), axis=1),
                         tl.max(tl.max(tl.abs(xb), axis=2), axis=1))
        e_bits = big.to(tl.int32, bitcast=True) & 0x7F800000
        scale = (0x7F000000 - e_bits).to(tl.float32, bitcast=True)[:, None, None]
        back = e_bits.to(tl.float32, bitcast=True)
        xa02, xa13 = _x_pairs(xa, scale)
        xb02, xb13 = _x_pairs(xb, scale)
        gi = (k0 + offs_g * SUB) // group
        g_ok = gi < n_groups
        s_lo, z_lo = _group_params(s_ptr, z_ptr, offs_j, j_ok, gi, g_ok, n_groups,
                                   HAS_ZEROS)
        s_hi, z_hi = _group_params(s_ptr, z_ptr, rows_hi, hi_ok, gi, g_ok, n_groups,
                                   HAS_ZEROS)
        # f16x2 pairs of 1024 + zero and 1024 + 16 * zero (exact: the zeros are integers)
        z1 = (0x6400 + z_lo.to(tl.int32)) * 0x10001
        z16 = (0x6400 + 16 * z_hi.to(tl.int32)) * 0x10001
        lo, hi = _pair_sums(wa, wb, xa02[None], xa13[None], xb02[None], xb13[None],
                            z1[:, :, None], z16[:, :, None], USE_ASM)
        acc_lo += lo * (s_lo * back[None, :])[:, :, None]
        # the high rows' sums are 16 * (code - zero) * x; 1/16 goes into the scale
        acc_hi += hi * (s_hi * (back * 0.0625)[None, :])[:, :, None]
        wa_at, wa, wb, xa, xb = next_at, wa_n, wb_n, xa_n, xb_n
    acc_lo = tl.sum(tl.sum(acc_lo, axis=2), axis=1)
    acc_hi = tl.sum(tl.sum(acc_hi, axis=2), axis=1)
    if HAS_BIAS:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid_k == 0:
            acc_lo += tl.load(bias_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)
            acc_hi += tl.load(bias_ptr + rows_hi, mask=hi_ok, other=0.0).to(tl.float32)
    if SPLIT:
        tl.atomic_add(out_ptr + offs_j, acc_lo, mask=j_ok)
        tl.atomic_add(out_ptr + rows_hi, acc_hi, mask=hi_ok)
    else:
        tl.store(out_ptr + offs_j, acc_lo.to(out_ptr.dtype.element_ty), mask=j_ok)
        tl.store(out_ptr + rows_hi, acc_hi.to(out_ptr.dtype.element_ty), mask=hi_ok)


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K, H, n_groups,
                      group, stride_xm, stride_om, HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # out = x @ w.T for a tile of BLOCK_M rows of x and BLOCK_J byte rows (output columns
    # [j0, j0 + BLOCK_J) and [H + j0, H + j0 + BLOCK_J)); each BLOCK_K-wide K tile lies in
    # one group. Programs walk the output in column bands of GROUP_M row tiles. IEEE:
    # the dots take fp32 operands in full precision (float32 activations, and bfloat16
    # ones under the interpreter, whose dot misreads bfloat16 tiles).
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_j = tl.cdiv(H, BLOCK_J)
    band = GROUP_M * tiles_j
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_j = (pid % band) // rows_in_band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = pid_j * BLOCK_J + tl.arange(0, BLOCK_J)
    m_ok = offs_m < M
    j_ok = offs_j < H
    rows_hi = offs_j + H
    hi_ok = rows_hi < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + offs_j[:, None].to(tl.int64) * K
    dtype = x_ptr.dtype.element_ty
    acc_lo = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(q_rows + k[None, :], mask=j_ok[:, None] & k_ok[None, :],
                    other=0).to(tl.int32)
        gi = tl.zeros((1,), dtype=tl.int32) + k0 // group
        s_lo, z_lo = _group_params(s_ptr, z_ptr, offs_j, j_ok, gi, gi < n_groups, n_groups,
                                   HAS_ZEROS)
        s_hi, z_hi = _group_params(s_ptr, z_ptr, rows_hi, hi_ok, gi, gi < n_groups,
                                   n_groups, HAS_ZEROS)
        w_lo = (_low_nibbles(b, z_lo) * s_lo).to(dtype)
        # the high nibbles' values are 16 * (code - zero); 1/16 goes into the scale
        w_hi = (_high_nibbles(b, z_hi) * (s_hi * 0.0625)).to(dtype)
        if IEEE:  # fp32 products of the same operands
            xf = x.to(tl.float32)
            acc_lo = tl.dot(xf, tl.trans(w_lo.to(tl.float32)), acc_lo, input_precision="ieee")
            acc_hi = tl.dot(xf, tl.trans(w_hi.to(tl.float32)), acc_hi, input_precision="ieee")
        else:
            acc_lo = tl.dot(x, tl.trans(w_lo), acc_lo)
            acc_hi = tl.dot(x, tl.trans(w_hi), acc_hi)
    if HAS_BIAS:
        acc_lo += tl.load(bias_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        acc_hi += tl.load(bias_ptr + rows_hi, mask=hi_ok, other=0.0).to(tl.float32)[None, :]
    out_rows = out_ptr + offs_m[:, None].to(tl.int64) * stride_om
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out_rows + offs_j[None, :], acc_lo.to(out_dtype),
             mask=m_ok[:, None] & j_ok[None, :])
    tl.store(out_rows + rows_hi[None, :], acc_hi.to(out_dtype),
             mask=m_ok[:, None] & hi_ok[None, :])


# ---- launchers -------------------------------------------------------------------------

def _interpreted(device: torch.device) -> bool:
    """Whether kernels for ``device`` run under Triton's interpreter."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def gemv_split(n_programs: int, n_chunks: int, num_sms: int) -> int:
    """K splits of a GEMV launch of ``n_programs`` output tiles, each walking ``n_chunks``
    chunks of K, on ``num_sms`` multiprocessors: 1 when the tiles alone give
    GEMV_MIN_PROGRAMS_PER_SM programs per multiprocessor, else enough splits for that
    (at most one per chunk)."""
    want = GEMV_MIN_PROGRAMS_PER_SM * num_sms
    if n_programs >= want:
        return 1
    return max(1, min(n_chunks, triton.cdiv(want, n_programs)))


def _gemv_split_out(x: torch.Tensor, w: Int4Packed, tiles: int, chunk: int,
                    split: int | None) -> tuple[int, int, torch.Tensor]:
    """(splits, columns a split, output) of a one-row launch of ``tiles`` row tiles over
    K in ``chunk``-wide chunks: split K by ``gemv_split`` unless ``split`` is given; a
    split launch adds into a zeroed fp32 output."""
    n_chunks = triton.cdiv(w.K, chunk)
    if split is None:
        split = gemv_split(tiles, n_chunks, num_multiprocessors(x.device))
    k_per_split = triton.cdiv(n_chunks, split) * chunk
    split = triton.cdiv(w.K, k_per_split)
    if split > 1:
        return split, k_per_split, torch.zeros((1, w.N), dtype=torch.float32, device=x.device)
    return split, k_per_split, torch.empty((1, w.N), dtype=x.dtype, device=x.device)


def _launch_gemv(x: torch.Tensor, w: Int4Packed, bias: torch.Tensor | None,
                 split: int | None = None) -> torch.Tensor:
    k, h = w.K, w.qweight.shape[0]
    n_groups = k // w.group
    chunk = min(GEMV_CHUNK, max(16, triton.next_power_of_2(k)))
    sub = chunk if n_groups == 1 else min(w.group, chunk)
    tiles = triton.cdiv(h, GEMV_BLOCK_J)
    split, k_per_split, out = _gemv_split_out(x, w, tiles, chunk, split)
    _int4_gemv_kernel[(tiles, split)](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.qweight,
        bias if bias is not None else w.scales, out, w.N, k, h, n_groups, w.group,
        k_per_split, HAS_ZEROS=w.zeros is not None, HAS_BIAS=bias is not None,
        SPLIT=split > 1, BLOCK_J=GEMV_BLOCK_J, GROUPS=chunk // sub, SUB=sub,
        num_warps=GEMV_WARPS, **pdl_args(x.device))
    return out.to(x.dtype) if split > 1 else out


def _launch_gemv_f16x2(x: torch.Tensor, w: Int4Packed, bias: torch.Tensor | None,
                       split: int | None = None) -> torch.Tensor:
    k, h = w.K, w.qweight.shape[0]
    sub = max(16, min(F16X2_SUB, w.group, triton.next_power_of_2(k)))
    chunk = max(sub, min(F16X2_CHUNK, triton.next_power_of_2(k)))
    tiles = triton.cdiv(h, F16X2_BLOCK_J)
    split, k_per_split, out = _gemv_split_out(x, w, tiles, chunk, split)
    _int4_gemv_f16x2_kernel[(tiles, split)](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.qweight,
        bias if bias is not None else w.scales, out, w.N, k, k // 4, h, k // w.group,
        w.group, k_per_split, HAS_ZEROS=w.zeros is not None, HAS_BIAS=bias is not None,
        SPLIT=split > 1, BLOCK_J=F16X2_BLOCK_J, GROUPS=chunk // sub, SUB=sub,
        USE_ASM=not _interpreted(x.device), num_warps=F16X2_WARPS, **pdl_args(x.device))
    return out.to(x.dtype) if split > 1 else out


def _gemm_config(m: int, group: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_J, BLOCK_K, num_warps, num_stages) of the dequantizing GEMM for m
    rows. Up to 16 rows take one 16-row tile (each weight tile is dequantized once) of 32
    byte rows (64 output columns) on 2 warps; more take 64 or 128-row tiles of 64 byte
    rows. A K tile lies inside one group."""
    block_k = 64 if group == k else min(64, group)
    if m <= 16:
        return 16, 32, 2 * block_k if group == k or group >= 128 else block_k, 2, 4
    if m <= 256:
        return 64, 64, block_k, 4, 3
    return 128, 64, block_k, 8, 3


def _launch_gemm(x: torch.Tensor, w: Int4Packed, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    h = w.qweight.shape[0]
    out = torch.empty((m, w.N), dtype=x.dtype, device=x.device)
    block_m, block_j, block_k, warps, stages = _gemm_config(m, w.group, k)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(h, block_j),)
    _int4_gemm_kernel[grid](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.qweight,
        bias if bias is not None else w.scales, out, m, w.N, k, h, k // w.group, w.group,
        x.stride(0), out.stride(0), HAS_ZEROS=w.zeros is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or (
            x.dtype == torch.bfloat16 and _interpreted(x.device)), BLOCK_M=block_m,
        BLOCK_J=block_j, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def int4_linear(x: torch.Tensor, w: Int4Packed,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize_int4(w).T + bias`` for x [..., K] float32, bfloat16 or float16;
    bias [N] or None. Returns [..., N] in x's dtype, accumulated in fp32 and rounded
    once. One row takes the GEMV (products in fp32 from the exact codes, each group's
    scale applied to its sum); more take the dequantizing GEMM, whose weight tiles are
    rounded to x's dtype as ``int4_linear_ref`` rounds the weight (up to 16 rows in one
    row tile, which reads the weight once)."""
    check_float("x", x, "int4_linear")
    if x.shape[-1] != w.K:
        raise ValueError(f"int4_linear needs x [..., {w.K}], got {tuple(x.shape)}")
    check_same_device("the weight", w.qweight, x, "x")
    if bias is not None:
        if bias.shape != (w.N,) or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{w.N}], got {tuple(bias.shape)}")
        check_same_device("bias", bias, x, "x")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or w.N == 0:
        return x.new_zeros((*lead, w.N))
    if x2.shape[0] == 1 and x2.dtype != torch.float32 and w.K % 4 == 0:
        out = _launch_gemv_f16x2(x2, w, bias)
    elif x2.shape[0] == 1:
        out = _launch_gemv(x2, w, bias)
    else:
        out = _launch_gemm(x2, w, bias)
    return out.reshape(*lead, w.N)
