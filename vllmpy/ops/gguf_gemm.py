"""``x @ W.T`` for a GGUF block-quantized ``W`` (a ``GGUFWeight``), dequantized in
registers: a fused dequant-GEMV for the one or two rows of small decode steps and a
dequant-GEMM on the tensor cores for more rows. No dense copy of the weight is made.

Reading the weights. Both kernels walk the reduction in chunks of ``CHUNK`` weights
(eight 32-weight blocks or one 256-weight super-block). A program reads a chunk of its
weight rows as NR runs of W 32-bit words of ``qs`` each (``_TILES``) with vector loads,
adjacent threads reading adjacent 16-byte pieces and every byte read once. Each byte of a
run holds P codes (nibbles, 2-bit crumbs or one int8), and byte j of a run holds code j of
each of the run's P parts, so a part of a run is a run of 4 W consecutive weights along K.
The kernels use the codes in the order the bytes hold them: instead of moving them into K
order they load the activations at the matching K positions (``_run_start``).

A code becomes a float without an int-to-float conversion (those run at a quarter of the
FP32 rate): ``_field`` masks it in place, at bit T of its word, and ORs in the exponent of
2^23, which makes the float 2^23 + code * 2^T; one subtraction then leaves
(code - offset) * 2^T exactly. The factor 2^T depends only on the code's place in the
word, so it is taken out of the activations (a multiply per activation, shared by all the
weight rows) rather than the weights. The 5- and 6-bit types' high bits come from units
of ``qh`` that line up with the words of ``qs`` (``gguf_quants._HIGH``) and are added the
same way. A weight then costs about three instructions: the mask, the subtraction and the
multiply-add.

GEMV (M <= ``GEMV_MAX_M``): a program owns ``GEMV_BLOCK_N`` output columns (weight rows)
and a range of chunks and keeps the activations it needs in registers. Per weight row, run
and part it sums q * x in fp32 and applies the part's scale once:
``d * sum(q x) - m * sum(x)``. The sums per run stay apart until the end, where one
reduction across the program's threads gives the outputs.

GEMM: [BLOCK_M, BLOCK_N] output tiles (``GEMM_CONFIGS``); each part of a chunk's weight
tile is dequantized, cast to the activation dtype and multiplied on the tensor cores, with
fp32 accumulation (float32 activations use IEEE fp32 products, not TF32). Up to 64 rows
the tile is computed transposed, weight rows first, for the MMA shapes that suits.

Split-K: when the output tiles alone give too few programs to fill the GPU
(``SPLIT_PROGRAMS_PER_SM``), K is split across programs. Each writes its fp32 partial
sums to a workspace, and the last program of a tile to arrive at the tile's counter (in
the weight, ``GGUFWeight.splitk_counters``, which it resets) adds the partials in split
order: the result does not depend on the order of arrival, and no second kernel runs.

The kernels launch a fixed grid for given (M, N, K) and never synchronise with the host,
so they can be captured in CUDA graphs; they also run under Triton's interpreter.
``gguf_linear_ref`` is the PyTorch reference.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.gguf_quants import GGUFWeight, check_quant_type
from vllmpy.ops.paged_attention import num_multiprocessors

# Weights of a row per loop iteration of either kernel: eight legacy blocks or one
# super-block.
CHUNK = 256
# Activation rows up to which gguf_linear takes the GEMV kernel; more take the GEMM: the
# GEMV's FMAs grow with the rows, the GEMM's 16-row tile costs the same up to 16, and their
# sm_90 instruction counts cross past two rows (docs/perf-log/quantized.md). The GEMV runs
# any M up to 8; benchmarks/investigations/gguf_kernels.py --cutover times both kernels.
GEMV_MAX_M = 2
# GEMV: weight rows per program and warps per program.
GEMV_BLOCK_N = 64
GEMV_WARPS = 4
# GEMM: (BLOCK_M, BLOCK_N, num_warps, num_stages, SWAP) for up to the given number of
# rows; the last entry serves every larger M. SWAP computes the tile as (W x^T)^T, which
# puts the 64 weight rows on the MMA's M side: on sm_90 a warpgroup MMA instead of 16-row
# mma.sync steps, for 15-35% fewer instructions per weight at up to 64 rows. All fit
# in 227 KB of shared memory (for sm_90; Q5_0 and Q5_1 spill 56 bytes at 64 rows).
GEMM_CONFIGS: tuple[tuple[int, tuple[int, int, int, int, bool]], ...] = (
    (16, (16, 64, 4, 3, True)), (32, (32, 64, 4, 3, True)), (64, (64, 64, 4, 2, True)),
    (1 << 62, (128, 64, 8, 2, False)))
# Split-K: when the output tiles give fewer programs than this many per multiprocessor,
# K is split across programs (the GEMV always, the GEMM up to GEMM_SPLIT_MAX_M rows,
# past which the fp32 partial sums would cost more traffic than they save).
SPLIT_PROGRAMS_PER_SM = 4
GEMM_SPLIT_MAX_M = 64

# A chunk is read as NR runs of W words (4 W bytes) of qs per weight row, each byte
# holding P codes: type -> (NR, W, P), NR * 4 W * P = CHUNK. See _load, _scales, _codes
# and _run_start.
_TILES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (8, 4, 2), "Q4_1": (8, 4, 2), "Q5_0": (8, 4, 2), "Q5_1": (8, 4, 2),
    "IQ4_NL": (8, 4, 2), "Q8_0": (8, 8, 1), "Q2_K": (4, 4, 4), "Q3_K": (4, 4, 4),
    "Q4_K": (4, 8, 2), "Q5_K": (4, 8, 2), "Q6_K": (8, 4, 2), "IQ4_XS": (8, 4, 2),
}
# type -> (bits per code in a byte of qs, bits per code with its high bits)
_CODE_BITS: dict[str, tuple[int, int]] = {
    "Q4_0": (4, 4), "Q4_1": (4, 4), "Q5_0": (4, 5), "Q5_1": (4, 5), "IQ4_NL": (4, 4),
    "Q8_0": (8, 8), "Q2_K": (2, 2), "Q3_K": (2, 3), "Q4_K": (4, 4), "Q5_K": (4, 5),
    "Q6_K": (4, 6), "IQ4_XS": (4, 4),
}
# types whose weights are d * q - m with a min of their own (the others have m = 0)
_AFFINE = frozenset({"Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"})


# The exponent bits of 2^23, passed to the kernels as an argument rather than written as
# a constant: as an argument it stays in one register, and ptxas encodes the masks of the
# fields as immediates; with both constant it keeps re-materialising the masks instead.
_MAGIC = 0x4B000000


@triton.jit
def _field(w, S: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, magic):
    """Bits S..S+BITS of the int32 words ``w`` as float32 (field - OFFSET) * 2^T, exactly,
    in two instructions and without an int-to-float conversion: the field is masked at
    bit T, which is S, or S - 12 after a shift when the field reaches past bit 22 (T +
    BITS <= 23 either way), and ``magic`` (``_MAGIC``, the exponent of 2^23) is OR-ed in
    above it, which makes the float 2^23 + field * 2^T; the subtraction is exact too."""
    T: tl.constexpr = S - 12 * (S + BITS > 23)
    bits = ((w >> (S - T)) & (((1 << BITS) - 1) << T)) | magic
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + OFFSET * (1 << T))


@triton.jit
def _field_hi(w, S: tl.constexpr, BITS: tl.constexpr, hi, SH: tl.constexpr,
              HBITS: tl.constexpr, OFFSET: tl.constexpr, magic):
    """As _field for a code whose low BITS bits are bits S.. of ``w`` and whose high
    HBITS bits are bits SH.. of ``hi``: the high bits are shifted above the low ones
    before the exponent goes in (T as in _field for a field of BITS + HBITS bits)."""
    T: tl.constexpr = S - 12 * (S + BITS + HBITS > 23)
    UP: tl.constexpr = T + BITS - SH  # how far the high bits move up
    if UP >= 0:
        high = hi << UP
    else:
        high = hi >> -UP
    bits = ((w >> (S - T)) & (((1 << BITS) - 1) << T)) \
        | ((high & (((1 << HBITS) - 1) << (T + BITS))) | magic)
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + OFFSET * (1 << T))


@triton.jit
def _code_scales(QT: tl.constexpr, P: tl.constexpr, PART_BITS: tl.constexpr,
                 CODE_BITS: tl.constexpr):
    """[4]: 2^-T of the codes _codes gives for part ``P`` of bytes k = 0..3 (each code's
    low bits at bit S = 8 k + PART_BITS * P of its word, CODE_BITS bits in all), what the
    activations are multiplied by; 1 for the IQ4 types, whose codes are table values."""
    s = 8 * tl.arange(0, 4) + PART_BITS * P
    t = s - 12 * (s + CODE_BITS > 23).to(tl.int32)
    scale = ((127 - t) << 23).to(tl.float32, bitcast=True)
    if QT == "IQ4_NL" or QT == "IQ4_XS":
        scale = tl.full((4,), 1.0, tl.float32)
    return scale


@triton.jit
def _codes(words, hi, tab_ptr, magic, QT: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """The codes of part ``P`` of byte ``K`` of every word, as float32 with the type's
    offset applied (the weights' q) times the power of two _code_scales takes out,
    [BLOCK_N, NR, W]; see gguf_quants._HIGH for where their high bits are."""
    if QT == "Q8_0":
        q = _field(words, 8 * K, 8, 128.0, magic)
    elif QT == "Q2_K":
        q = _field(words, 8 * K + 2 * P, 2, 0.0, magic)
    elif QT == "Q3_K":  # high bit: bit 4 P + K of the unit
        q = _field_hi(words, 8 * K + 2 * P, 2, hi, 4 * P + K, 1, 4.0, magic)
    elif QT == "Q6_K":  # high bits: bits 2 (4 P + K) and up of the unit
        q = _field_hi(words, 8 * K + 4 * P, 4, hi, 8 * P + 2 * K, 2, 32.0, magic)
    elif QT == "Q5_0":  # high bit: bit 4 P + K of the unit
        q = _field_hi(words, 8 * K + 4 * P, 4, hi, 4 * P + K, 1, 16.0, magic)
    elif QT == "Q5_1" or QT == "Q5_K":
        q = _field_hi(words, 8 * K + 4 * P, 4, hi, 4 * P + K, 1, 0.0, magic)
    elif QT == "IQ4_NL" or QT == "IQ4_XS":
        q = tl.load(tab_ptr + ((words >> (8 * K + 4 * P)) & 15))
    elif QT == "Q4_0":
        q = _field(words, 8 * K + 4 * P, 4, 8.0, magic)
    else:  # Q4_1, Q4_K
        q = _field(words, 8 * K + 4 * P, 4, 0.0, magic)
    return q


@triton.jit
def _load(qs_ptr, qh_ptr, d_ptr, dm_ptr, rows, s_qs, s_qh, s_d, c, nblk, QT: tl.constexpr,
          SMALL: tl.constexpr, NR: tl.constexpr, W: tl.constexpr):
    """The words of chunk ``c`` of weight rows ``rows`` (int64 [BLOCK_N], all < N), each
    loaded once: ``words`` int32 [BLOCK_N, NR, W], NR runs of W words of ``qs``; ``hi``
    the qh unit of each word (int32, same shape); the block scales ``d`` and mins ``m``
    (float32, [BLOCK_N, NR] for 32-weight blocks (``SMALL``), [BLOCK_N, 1] for a
    super-block). What a type lacks is stood in for by ``words``. Blocks past the row's
    end (``nblk`` blocks) read its last block; their K indices are >= K."""
    r = tl.arange(0, NR)
    rd = rows[:, None] * s_d
    if SMALL:  # run r is block NR c + r
        run = tl.minimum(c * NR + r, nblk - 1)
        d = tl.load(d_ptr + rd + run[None, :]).to(tl.float32)
        if QT == "Q4_1" or QT == "Q5_1":
            m = tl.load(dm_ptr + rd + run[None, :]).to(tl.float32)
        else:
            m = d
    else:  # one super-block of NR consecutive runs
        run = c * NR + r
        d = tl.load(d_ptr + rd + c).to(tl.float32)
        if QT == "Q2_K" or QT == "Q4_K" or QT == "Q5_K":
            m = tl.load(dm_ptr + rd + c).to(tl.float32)
        else:
            m = d
    at = (run * W)[None, :, None] + tl.arange(0, W)[None, None, :]
    words = tl.load(qs_ptr + rows[:, None, None] * s_qs + at)
    if QT == "Q8_0":
        words = words ^ -0x7F7F7F80  # 0x80808080: int8 codes + 128, unsigned bytes
    if QT == "Q5_0" or QT == "Q5_1" or QT == "Q5_K" or QT == "Q6_K" or QT == "Q3_K":
        hi = tl.load(qh_ptr + rows[:, None, None] * s_qh + at).to(tl.int32)
    else:
        hi = words
    return words, hi, d, m


@triton.jit
def _scales(sc_ptr, d, m, rows, s_sc, c, QT: tl.constexpr, NR: tl.constexpr,
            P: tl.constexpr):
    """Part ``P``'s scale ``sd`` and min ``smn`` of each run (float32 [BLOCK_N, NR]);
    the weights are sd * q - smn (``smn`` only means something for the affine types)."""
    r = tl.arange(0, NR)
    if QT == "Q4_K" or QT == "Q5_K":
        # run r is qs[32 r:][:32], which holds sub-blocks 2 r (low nibbles) and 2 r + 1;
        # their 6-bit scale and min in the 12 packed bytes
        sub = 2 * r + P
        sc_at = sc_ptr + rows[:, None] * s_sc + c * 12 + sub[None, :]
        b_i = tl.load(sc_at).to(tl.int32)  # byte i
        b_4 = tl.load(sc_at + 4).to(tl.int32)  # byte i + 4
        b_lo = tl.load(sc_at - (sub[None, :] // 4) * 4).to(tl.int32)  # byte i % 4
        first = sub[None, :] < 4
        sc = tl.where(first, b_i & 63, (b_4 & 15) | ((b_lo >> 6) << 4))
        mn = tl.where(first, b_4 & 63, (b_4 >> 4) | ((b_i >> 6) << 4))
        sd = d * sc.to(tl.float32)
        smn = m * mn.to(tl.float32)
    elif QT == "Q2_K" or QT == "Q3_K":
        # run r = (h, j) = (r // 2, r % 2); part P is crumb s = P: group 8 h + 2 s + j
        group = (r // 2) * 8 + 2 * P + r % 2
        if QT == "Q2_K":
            sb = tl.load(sc_ptr + rows[:, None] * s_sc + c * 16 + group[None, :]).to(tl.int32)
            sd = d * (sb & 15).to(tl.float32)
            smn = m * (sb >> 4).to(tl.float32)
        else:
            sc_row = sc_ptr + rows[:, None] * s_sc + c * 12
            low = tl.load(sc_row + (group % 8)[None, :]).to(tl.int32)
            high = tl.load(sc_row + (8 + group % 4)[None, :]).to(tl.int32)
            six = ((low >> ((group // 8) * 4)[None, :]) & 15) \
                | (((high >> ((group // 4) * 2)[None, :]) & 3) << 4)
            sd = d * (six - 32).to(tl.float32)
            smn = sd
    elif QT == "Q6_K":
        # run r = (h, t, j) = (r // 4, r // 2 % 2, r % 2); part P is nibble P: s = t + 2 P,
        # group 8 h + 2 s + j
        group = (r // 4) * 8 + 2 * ((r // 2) % 2 + 2 * P) + r % 2
        sc = tl.load(sc_ptr + rows[:, None] * s_sc + c * 16 + group[None, :])  # int8
        sd = d * sc.to(tl.float32)
        smn = sd
    elif QT == "IQ4_XS":
        # run r is sub-block r; scales_h (2 bytes) then scales_l (4 bytes)
        sc_row = sc_ptr + rows[:, None] * s_sc + c * 6
        high = tl.load(sc_row + (r // 4)[None, :]).to(tl.int32)
        low = tl.load(sc_row + (2 + r // 2)[None, :]).to(tl.int32)
        six = ((low >> ((r % 2) * 4)[None, :]) & 15) \
            | (((high >> ((r % 4) * 2)[None, :]) & 3) << 4)
        sd = d * (six - 32).to(tl.float32)
        smn = sd
    else:  # 32-weight blocks: the block scale (Q4_1, Q5_1: w = d q + m)
        sd = d
        smn = -m
    return sd, smn


@triton.jit
def _run_start(c, QT: tl.constexpr, NR: tl.constexpr, P: tl.constexpr):
    """The K index of the code in byte 0, part ``P`` of each run of chunk ``c`` ([NR]);
    byte j of a run holds code j of its part, so a run's codes are consecutive in K.
    For 32-weight blocks the index runs past K for blocks past the row's end."""
    r = tl.arange(0, NR)
    if QT == "Q8_0":  # block 8 c + r
        start = (c * 8 + r) * 32
    elif QT == "Q4_K" or QT == "Q5_K":  # sub-block 2 r + P
        start = c * 256 + (2 * r + P) * 32
    elif QT == "Q2_K" or QT == "Q3_K":  # run (h, j), crumb P: 128 h + 32 P + 16 j
        start = c * 256 + (r // 2) * 128 + 32 * P + (r % 2) * 16
    elif QT == "Q6_K":  # run (h, t, j), nibble P: 128 h + 32 (t + 2 P) + 16 j
        start = c * 256 + (r // 4) * 128 + ((r // 2) % 2 + 2 * P) * 32 + (r % 2) * 16
    elif QT == "IQ4_XS":  # sub-block r, nibble P
        start = c * 256 + r * 32 + 16 * P
    else:  # block 8 c + r, nibble P
        start = (c * 8 + r) * 32 + 16 * P
    return start


@triton.jit
def _x_offsets(start, W: tl.constexpr):
    # [NR, W, 4]: the K index of byte k of word w of each run
    return start[:, None, None] + (tl.arange(0, W) * 4)[None, :, None] \
        + tl.arange(0, 4)[None, None, :]


@triton.jit
def _store_out(res, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om,
               HAS_BIAS: tl.constexpr):
    # res: float32 [BLOCK_M, BLOCK_N] -> out, rounded once to out's dtype
    n_ok = offs_n < N
    if HAS_BIAS:
        res += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, res.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _split4(v, NR: tl.constexpr, W: tl.constexpr):
    # [NR, W, 4] -> its four [NR, W] slices along the last dim
    a, b = tl.split(tl.reshape(v, (NR, W, 2, 2)))
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _join4(v0, v1, v2, v3):
    # four [..., NR, W] tensors -> [..., NR, W, 2, 2], which reshaped to [..., NR, W, 4]
    # is the inverse of _split4
    return tl.join(tl.join(v0, v2), tl.join(v1, v3))


@triton.jit
def _finish(res, ws_ptr, cnt_ptr, tile, pid_k, bias_ptr, out_ptr, offs_m, offs_n, M, N,
            stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store a program's fp32 sums ``res`` [BLOCK_M, BLOCK_N] of output tile ``tile``.
    With ``SPLIT_K`` each of the tile's programs (program_id(1) = ``pid_k``) writes its
    partial sums to the workspace [splits, M, N]; the last to arrive at the tile's counter
    adds them all, in split order, stores the output and resets the counter to zero."""
    if SPLIT_K:
        splits = tl.num_programs(1)
        tile_at = offs_m[:, None] * N + offs_n[None, :]
        ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile_at, res, mask=ok)
        tl.debug_barrier()  # every thread's partial is written before the arrival
        arrived = tl.atomic_add(cnt_ptr + tile, 1)  # acq_rel, GPU scope
        if arrived == splits - 1:
            total = tl.zeros_like(res)
            for s in range(0, splits):
                total += tl.load(ws_ptr + s * M * N + tile_at, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            _store_out(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)
    else:
        _store_out(res, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _gemv_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, dm_ptr, tab_ptr, bias_ptr, out_ptr, ws_ptr,
    cnt_ptr, magic, M, N, K, nblk, n_chunks, chunks_per_split, stride_xm, stride_om,
    s_qs, s_qh, s_sc, s_d,
    QT: tl.constexpr, SMALL: tl.constexpr, NR: tl.constexpr, W: tl.constexpr,
    PARTS: tl.constexpr, PART_BITS: tl.constexpr, CODE_BITS: tl.constexpr,
    HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read the last one
    # per-run sums of each activation row, reduced across the program's threads once
    acc = tl.zeros((BLOCK_M, BLOCK_N, NR), dtype=tl.float32)
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, n_chunks)
    for c in range(c_lo, c_hi):
        words, hi, d, m = _load(qs_ptr, qh_ptr, d_ptr, dm_ptr, rows, s_qs, s_qh, s_d, c,
                                nblk, QT, SMALL, NR, W)
        for p in tl.static_range(PARTS):
            sd, smn = _scales(sc_ptr, d, m, rows, s_sc, c, QT, NR, p)
            koff = _x_offsets(_run_start(c, QT, NR, p), W)
            k_ok = koff < K
            q0 = _codes(words, hi, tab_ptr, magic, QT, p, 0)
            q1 = _codes(words, hi, tab_ptr, magic, QT, p, 1)
            q2 = _codes(words, hi, tab_ptr, magic, QT, p, 2)
            q3 = _codes(words, hi, tab_ptr, magic, QT, p, 3)
            for i in tl.static_range(BLOCK_M):
                row = tl.minimum(i, M - 1)  # rows past M (BLOCK_M is a power of two) repeat
                xv = tl.load(x_ptr + row * stride_xm + koff, mask=k_ok, other=0.0)
                xv = xv.to(tl.float32)
                x0, x1, x2, x3 = _split4(xv * _code_scales(QT, p, PART_BITS, CODE_BITS)[None, None, :],
                                         NR, W)
                t = q0 * x0[None] + q1 * x1[None] + q2 * x2[None] + q3 * x3[None]
                part = sd * tl.sum(t, axis=2)  # [BLOCK_N, NR]
                if HAS_MIN:
                    part -= smn * tl.sum(tl.sum(xv, axis=2), axis=1)[None, :]
                if BLOCK_M == 1:
                    acc += part[None]
                else:
                    acc = tl.where(offs_m[:, None, None] == i, acc + part[None], acc)
    res = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    _finish(res, ws_ptr, cnt_ptr, pid_n, pid_k, bias_ptr, out_ptr, offs_m, offs_n, M, N,
            stride_om, HAS_BIAS, SPLIT_K)


@triton.jit
def _dequant(words, hi, tab_ptr, magic, sd, smn, QT: tl.constexpr, P: tl.constexpr,
             K: tl.constexpr, PART_BITS: tl.constexpr, CODE_BITS: tl.constexpr,
             HAS_MIN: tl.constexpr):
    # the weights of part P of byte K of every word, float32 [BLOCK_N, NR, W]
    q = _codes(words, hi, tab_ptr, magic, QT, P, K)
    if QT == "IQ4_NL" or QT == "IQ4_XS":
        w = sd[:, :, None] * q
    else:  # the codes carry 2^T (see _field)
        S: tl.constexpr = 8 * K + PART_BITS * P
        T: tl.constexpr = S - 12 * (S + CODE_BITS > 23)
        w = (sd * (1.0 / (1 << T)))[:, :, None] * q
    if HAS_MIN:
        w -= smn[:, :, None]
    return w


@triton.jit
def _gemm_kernel(
    x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, dm_ptr, tab_ptr, bias_ptr, out_ptr, ws_ptr,
    cnt_ptr, magic, M, N, K, nblk, n_chunks, chunks_per_split, stride_xm, stride_om,
    s_qs, s_qh, s_sc, s_d,
    QT: tl.constexpr, SMALL: tl.constexpr, NR: tl.constexpr, W: tl.constexpr,
    PARTS: tl.constexpr, PART_BITS: tl.constexpr, CODE_BITS: tl.constexpr,
    HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
    SWAP: tl.constexpr,
):
    # grouped order: GROUP_M consecutive programs share a weight tile (read through L2)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty
    if SWAP:  # acc^T: the weight rows on the MMA's M side
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_lo = pid_k * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, n_chunks)
    for c in range(c_lo, c_hi):
        words, hi, d, m = _load(qs_ptr, qh_ptr, d_ptr, dm_ptr, rows, s_qs, s_qh, s_d, c,
                                nblk, QT, SMALL, NR, W)
        for p in tl.static_range(PARTS):
            sd, smn = _scales(sc_ptr, d, m, rows, s_sc, c, QT, NR, p)
            w = _join4(
                _dequant(words, hi, tab_ptr, magic, sd, smn, QT, p, 0, PART_BITS, CODE_BITS,
                         HAS_MIN),
                _dequant(words, hi, tab_ptr, magic, sd, smn, QT, p, 1, PART_BITS, CODE_BITS,
                         HAS_MIN),
                _dequant(words, hi, tab_ptr, magic, sd, smn, QT, p, 2, PART_BITS, CODE_BITS,
                         HAS_MIN),
                _dequant(words, hi, tab_ptr, magic, sd, smn, QT, p, 3, PART_BITS, CODE_BITS,
                         HAS_MIN))
            w = tl.reshape(w, (BLOCK_N, NR * W * 4)).to(dtype)
            kk = tl.reshape(_x_offsets(_run_start(c, QT, NR, p), W), (NR * W * 4,))
            xt = tl.load(x_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            if WIDEN:  # exact: a product of two bfloat16 values fits a float32
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
            if SWAP:
                acc = tl.dot(w, tl.trans(xt), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(xt, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SWAP:
        res = tl.trans(acc)
    else:
        res = acc
    _finish(res, ws_ptr, cnt_ptr, pid, pid_k, bias_ptr, out_ptr, offs_m, offs_n, M, N,
            stride_om, HAS_BIAS, SPLIT_K)


def _plane_args(weight: GGUFWeight) -> tuple[list[torch.Tensor], list[int]]:
    """The kernels' plane pointers (qs as int32 words, qh, scales, d, dm, table; an absent
    plane is stood in for by qs, never read) and row strides (qs in words, qh, scales,
    d)."""
    qs = weight.qs.view(torch.int32)
    planes = [qs, weight.qh, weight.scales, weight.d, weight.dm, weight.table]
    ptrs = [qs if p is None else p for p in planes]
    strides = [p.stride(0) if p is not None else 0 for p in (qs, weight.qh, weight.scales)]
    return ptrs, [*strides, weight.d.stride(0)]


def _type_args(weight: GGUFWeight) -> dict[str, object]:
    """The constexprs that describe the weight's type to the kernels."""
    runs, words, parts = _TILES[weight.quant_type]
    part_bits, code_bits = _CODE_BITS[weight.quant_type]
    return dict(QT=weight.quant_type, SMALL=weight.block_size == 32, NR=runs, W=words,
                PARTS=parts, PART_BITS=part_bits, CODE_BITS=code_bits,
                HAS_MIN=weight.quant_type in _AFFINE)


def split_k(tiles: int, chunks: int, device: torch.device) -> int:
    """How many programs share the reduction of one output tile: about enough for the
    grid of ``tiles`` tiles to fill ``SPLIT_PROGRAMS_PER_SM`` programs per multiprocessor,
    with every split but the last taking the same number of the ``chunks`` chunks."""
    want = round(num_multiprocessors(device) * SPLIT_PROGRAMS_PER_SM / tiles)
    splits = min(chunks, max(1, want))
    return triton.cdiv(chunks, triton.cdiv(chunks, splits))


def _launch(kernel, grid_tiles: int, x: torch.Tensor, weight: GGUFWeight,
            bias: torch.Tensor | None, out: torch.Tensor, splits: int,
            **meta: object) -> None:
    """Launch ``kernel`` over ``grid_tiles`` output tiles, K split ``splits`` ways (as
    evenly as the chunks go), with a workspace for the partial sums when split."""
    m, k = x.shape
    chunks = triton.cdiv(k, CHUNK)
    per_split = triton.cdiv(chunks, splits)
    splits = triton.cdiv(chunks, per_split)
    if splits > 1:
        assert grid_tiles <= weight.splitk_counters.numel()
        workspace = torch.empty((splits, m, weight.rows), dtype=torch.float32,
                                device=x.device)
    else:
        workspace = out
    ptrs, strides = _plane_args(weight)
    kernel[(grid_tiles, splits)](
        x, *ptrs, bias if bias is not None else out, out, workspace,
        weight.splitk_counters, _MAGIC, m, weight.rows, k, k // weight.block_size, chunks,
        per_split, x.stride(0), out.stride(0), *strides, **_type_args(weight),
        HAS_BIAS=bias is not None, SPLIT_K=splits > 1, **meta)


def _gemv(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None,
          out: torch.Tensor, splits: int | None = None) -> None:
    """The GEMV kernel into ``out`` (M <= 8); ``splits`` overrides split_k's choice."""
    assert x.shape[0] <= 8, "the GEMV kernel takes up to 8 rows"
    tiles = triton.cdiv(weight.rows, GEMV_BLOCK_N)
    if splits is None:
        splits = split_k(tiles, triton.cdiv(x.shape[1], CHUNK), x.device)
    _launch(_gemv_kernel, tiles, x, weight, bias, out, splits,
            BLOCK_M=triton.next_power_of_2(x.shape[0]), BLOCK_N=GEMV_BLOCK_N,
            num_warps=GEMV_WARPS)


def gemm_config(m: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, SWAP) of the GEMM for ``m`` rows."""
    for max_m, config in GEMM_CONFIGS:
        if m <= max_m:
            return config
    return GEMM_CONFIGS[-1][1]


def _gemm(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None,
          out: torch.Tensor, splits: int | None = None) -> None:
    """The GEMM kernel into ``out``; ``splits`` overrides split_k's choice."""
    m, k = x.shape
    block_m, block_n, warps, stages, swap = gemm_config(m)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(weight.rows, block_n)
    if splits is None:
        splits = split_k(tiles, triton.cdiv(k, CHUNK), x.device) \
            if m <= GEMM_SPLIT_MAX_M else 1
    # Triton's interpreter multiplies bfloat16 dot operands as their integer bit patterns;
    # there the operands are widened to float32 first, which gives the same products.
    widen = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"
    _launch(_gemm_kernel, tiles, x, weight, bias, out, splits, BLOCK_M=block_m,
            BLOCK_N=block_n, GROUP_M=8,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 or widen else "tf32",
            WIDEN=widen, SWAP=swap, num_warps=warps, num_stages=stages)


def _check(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None,
           out: torch.Tensor | None) -> None:
    check_quant_type(weight.quant_type)
    check_float("x", x, "GGUF matmul kernels")
    if x.dim() != 2 or x.shape[1] != weight.cols:
        raise ValueError(f"x must be [M, {weight.cols}]; got {tuple(x.shape)}")
    check_same_device("x", x, weight.qs, "the weight")
    if weight.splitk_counters.numel() < weight.rows \
            or weight.splitk_counters.device != x.device:
        raise ValueError("the weight's split-K counters are missing; build it with prepare()")
    if bias is not None:
        check_float("bias", bias, "GGUF matmul kernels")
        check_same_device("bias", bias, x, "x")
        if tuple(bias.shape) != (weight.rows,) or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{weight.rows}] vector; got "
                             f"{tuple(bias.shape)}")
    if out is not None:
        check_same_device("out", out, x, "x")
        if tuple(out.shape) != (x.shape[0], weight.rows) or out.dtype != x.dtype \
                or (out.shape[1] > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be {x.dtype} [{x.shape[0]}, {weight.rows}] with "
                             f"unit column stride; got {out.dtype} {tuple(out.shape)} "
                             f"strides {out.stride()}")


def gguf_linear(x: torch.Tensor, weight: GGUFWeight, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)``: x [M, K] (float32, bfloat16 or float16) -> [M, N] in x's
    dtype, with fp32 accumulation. ``out``, when given, is written and returned; it may be
    a column slice of a wider buffer (any row stride, unit column stride)."""
    _check(x, weight, bias, out)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty((m, weight.rows), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m <= GEMV_MAX_M:
        _gemv(x, weight, bias, out)
    else:
        _gemm(x, weight, bias, out)
    return out


def gguf_linear_ref(x: torch.Tensor, weight: GGUFWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch reference: the dense weights rounded to x's dtype, then ``F.linear``."""
    return F.linear(x, weight.dequantize(x.dtype), bias)

