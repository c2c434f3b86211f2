"""FP8 (e4m3) W8A8 linear layers: activation quantization, block-scaled and per-channel
scaled GEMMs, and the PyTorch references they are tested against.

Formats
-------
Weights are ``torch.float8_e4m3fn`` [N, K] (row n is output n, contiguous along K) with
fp32 scales that multiply the stored values: ``w[n, k] = wq[n, k] * scale(n, k)``.

- Block-scaled (DeepSeek-V3, Qwen3-FP8): ``weight_scale`` [ceil(N / bn), ceil(K / bk)],
  one scale per ``bn x bk`` block (checkpoints call it ``weight_scale_inv``; it is the
  multiplier all the same). ``block = (bn, bk)`` is (128, 128) in every known checkpoint;
  the last block row and column may be partial.
- Per-tensor or per-channel: ``weight_scale`` with one element, or [N, 1] (or [N]).

Activations are quantized the same way everywhere: a scale ``s`` per tensor, per token
(row) or per 1 x group slice of a row, and codes ``fp8(clamp(x * (1 / s), -448, 448))``
rounded to nearest even, where ``1 / s`` is the fp32 reciprocal rounded once. A dynamic
scale is ``max(amax(|x|), AMAX_FLOOR) / 448`` in fp32 (never 0, so an all-zero row gives
zero codes); a static one is given. The kernels compute exactly these codes and scales, so
the references use the same quantized activations and differ from the kernels only in
the order of the fp32 sums.

Conversion to fp8
-----------------
On a GPU the kernels round with the hardware conversion. Triton's interpreter (the CPU)
rounds some fp32 -> e4m3 conversions wrongly (those that carry into the exponent), so
under it the kernels encode e4m3 from the fp32 bits instead (``_e4m3_bits``, exact
round-to-nearest-even) and reinterpret the byte; loading fp8 and widening it is exact
there, as is ``tl.dot`` on fp8 tiles.

Paths
-----
Decode is a read of the weight, so every path for few rows streams it once. One row
takes a GEMV launch that quantizes the activation chunks itself (a decode step pays no
separate quantization kernel). More rows are quantized by a kernel, then multiplied by
a Triton ``tl.dot`` GEMM on fp8 tiles (up to 16 rows in one row tile, so each weight tile
is read once) or, for ``fp8_scaled_linear`` on a GPU, by ``torch._scaled_mm``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.paged_attention import num_multiprocessors
from vllmpy.ops.pdl import pdl_args, pdl_wait

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# The smallest amax a dynamic scale is computed from: an all-zero slice gets a tiny
# non-zero scale (and zero codes) instead of a division by zero.
AMAX_FLOOR = 1e-12
# The one-row GEMVs: GEMV_BLOCK_N weight rows a program (fewer when a block-scaled
# weight's block height is not a multiple of it), walked in GEMV_CHUNK-wide chunks on
# GEMV_WARPS warps, each thread keeping an fp32 sum per weight element it holds until the
# end. Compiled for sm_90 (ptxas 12.x), the block-scaled GEMV's loop issues 3.9
# instructions per weight byte: 2.5 for widening and multiplying the weight, the rest for
# quantizing the row, which every program repeats, so fewer rows a program cost more
# (8 rows: 5.0). A program has 16 KiB of weight loads in flight and takes 241 registers,
# so two fit a multiprocessor; Qwen3-8B's projections run 256 (N = 4,096) to 1,536
# programs.
GEMV_BLOCK_N = 16
GEMV_CHUNK = 1024
GEMV_WARPS = 4
# A GEMV splits K when it would otherwise run fewer programs than this many per
# multiprocessor (splitting costs two more launches: zeroing the fp32 output and
# rounding it).
GEMV_MIN_PROGRAMS_PER_SM = 1

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)

_DYNAMIC = ("per_token", "per_tensor")


def native_fp8(device: torch.device) -> bool:
    """Whether kernels on ``device`` convert to fp8 with the hardware instruction (a GPU),
    rather than by bit arithmetic (Triton's interpreter)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


# ---- fp8 helpers shared by the kernels -------------------------------------------------

@triton.jit
def _e4m3_bits(v):
    # e4m3 codes (uint8) of fp32 values already clamped to [-448, 448], rounded to
    # nearest even. Normal results keep the top 3 fp32 mantissa bits after adding half a
    # unit (less one, plus the kept lowest bit: ties go to even); a carry moves into the
    # exponent, which is rebiased from 127 to 7. Below 2^-6 the result is a multiple of
    # 2^-9: adding 2^14, whose fp32 spacing is 2^-9, rounds it, and the sum's low mantissa
    # bits are the code.
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    tiny = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    code = tl.where(mag < 0x3C800000, tiny, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _to_fp8(v, NATIVE: tl.constexpr):
    # fp32 -> e4m3, saturated to +-448 and rounded to nearest even
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    if NATIVE:
        return v.to(tl.float8e4nv)
    return _e4m3_bits(v).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _recip(v):
    # 1 / v in fp32, rounded once (the kernels and the references agree on it)
    return tl.div_rn(tl.zeros_like(v) + 1.0, v)


@triton.jit
def _scale_of(amax):
    # the dynamic scale of a slice whose largest magnitude is amax, and its reciprocal
    scale = tl.div_rn(tl.maximum(amax, _AMAX_FLOOR), tl.zeros_like(amax) + _FP8_MAX)
    return scale, _recip(scale)


# ---- activation quantization ----------------------------------------------------------

@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_xm, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    # amax_ptr[0] = max(amax_ptr[0], max |x| over this program's tile)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                mask=mask, other=0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0))


@triton.jit
def _quant_tensor_kernel(x_ptr, q_ptr, src_ptr, scale_ptr, M, K, stride_xm,
                         STATIC_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_K: tl.constexpr, NATIVE: tl.constexpr):
    # one scale for the whole tensor: src_ptr holds it (STATIC_SCALE) or the tensor's
    # amax, from which every program derives it and program (0, 0) stores it
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if STATIC_SCALE:
        scale = tl.load(src_ptr)
        inv = _recip(scale)
    else:
        scale, inv = _scale_of(tl.load(src_ptr))
        if (pid_m == 0) & (pid_k == 0):
            tl.store(scale_ptr, scale)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    rows = offs_m[:, None].to(tl.int64)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    tl.store(q_ptr + rows * K + offs_k[None, :], _to_fp8(x.to(tl.float32) * inv, NATIVE),
             mask=mask)


@triton.jit
def _quant_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, BLOCK_K: tl.constexpr,
                        NATIVE: tl.constexpr):
    # one program per row: its amax, then its codes (the second pass reads from L2)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale, inv = _scale_of(tl.max(amax, axis=0))
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        tl.store(q_ptr + row * K + offs, _to_fp8(x.to(tl.float32) * inv, NATIVE),
                 mask=offs < K)


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, scale_ptr, K, n_groups, stride_xm,
                        GROUPS: tl.constexpr, GROUP: tl.constexpr, NATIVE: tl.constexpr):
    # program (row, i) quantizes groups [i * GROUPS, (i + 1) * GROUPS) of one row
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs_k < K
    x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    scale, inv = _scale_of(tl.max(tl.abs(x), axis=1))
    tl.store(scale_ptr + row * n_groups + offs_g, scale, mask=offs_g < n_groups)
    tl.store(q_ptr + row * K + offs_k, _to_fp8(x * inv[:, None], NATIVE), mask=mask)


def _check_activation(x: torch.Tensor, op: str) -> None:
    check_float("x", x, op)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{op} needs x [M, K] contiguous in its last dimension, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")


def quant_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] to fp8 with one scale: ``(xq [M, K] fp8, scale fp32)``.

    With ``scale`` (a one-element fp32 tensor) the quantization is static and that tensor
    is returned; without, the scale is ``max(amax(|x|), AMAX_FLOOR) / 448``, computed on
    the device by two launches (an atomic max, then the codes) and returned as a [1]
    tensor: no host synchronization, so it can be captured in a CUDA graph."""
    _check_activation(x, "fp8 quantization kernels")
    m, k = x.shape
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    block_m, block_k = 16, 256
    grid = (triton.cdiv(m, block_m), triton.cdiv(k, block_k))
    if scale is not None:
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(f"a static scale is one float32 element, got {scale.dtype} "
                             f"{tuple(scale.shape)}")
        check_same_device("scale", scale, x, "x")
        if m and k:
            _quant_tensor_kernel[grid](x, xq, scale, scale, m, k, x.stride(0),
                                       STATIC_SCALE=True, BLOCK_M=block_m, BLOCK_K=block_k,
                                       NATIVE=native_fp8(x.device))
        return xq, scale
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    out_scale = torch.empty(1, dtype=torch.float32, device=x.device)
    if m and k:
        _amax_kernel[grid](x, amax, m, k, x.stride(0), BLOCK_M=block_m, BLOCK_K=block_k)
        _quant_tensor_kernel[grid](x, xq, amax, out_scale, m, k, x.stride(0),
                                   STATIC_SCALE=False, BLOCK_M=block_m, BLOCK_K=block_k,
                                   NATIVE=native_fp8(x.device))
    else:
        out_scale.fill_(AMAX_FLOOR / FP8_MAX)
    return xq, out_scale


def quant_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of x [M, K] with its own dynamic scale:
    ``(xq [M, K] fp8, scale [M, 1] fp32)``, ``scale[m] = max(amax(|x[m]|), AMAX_FLOOR) /
    448``. The scale is contiguous, as ``torch._scaled_mm``'s row-wise scaling needs."""
    _check_activation(x, "fp8 quantization kernels")
    m, k = x.shape
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block_k = min(1024, triton.next_power_of_2(max(k, 16)))
        _quant_token_kernel[(m,)](x, xq, scale, k, x.stride(0), BLOCK_K=block_k,
                                  NATIVE=native_fp8(x.device), num_warps=4)
    return xq, scale


def quant_fp8_per_group(x: torch.Tensor, group: int = 128
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] per 1 x ``group`` slice of each row (DeepSeek-V3's activation
    groups): ``(xq [M, K] fp8, scale [M, ceil(K / group)] fp32)``, row-major, with
    ``scale[m, g] = max(amax(|x[m, g*group:(g+1)*group]|), AMAX_FLOOR) / 448``. The last
    group of a row is partial when group does not divide K. ``group`` is a power of
    two."""
    _check_activation(x, "fp8 quantization kernels")
    if group < 1 or group & (group - 1):
        raise ValueError(f"the group size must be a power of two, got {group}")
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m and k:
        groups = max(1, min(triton.next_power_of_2(n_groups), 2048 // group))
        _quant_group_kernel[(m, triton.cdiv(n_groups, groups))](
            x, xq, scale, k, n_groups, x.stride(0), GROUPS=groups, GROUP=group,
            NATIVE=native_fp8(x.device))
    return xq, scale


# ---- block-scaled GEMM and GEMV -------------------------------------------------------

@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                           stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                           HAS_BIAS: tl.constexpr, SCALE_N: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # C = sum over K blocks kb of (A[:, kb] @ B[:, kb].T) * a_scale[:, kb] * b_scale[n // SCALE_N, kb]
    # A: fp8 [M, K] with scales [M, cdiv(K, BLOCK_K)]; B: fp8 [N, K] with scales
    # [cdiv(N, SCALE_N), cdiv(K, BLOCK_K)]. Programs walk the output in column bands of
    # GROUP_M row tiles, so that neighbours share B tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # rows past M or N re-read the last one (never stored), so that only K is masked;
    # the tile pointers are formed once and advanced a K tile at a time
    rows_a = tl.minimum(offs_m, M - 1)
    rows_b = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_tile = b_ptr + rows_b[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_rows = as_ptr + rows_a * stride_asm
    bs_rows = bs_ptr + (rows_b // SCALE_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_tile, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_tile, mask=offs_k[:, None] < k_left, other=0.0)  # [BLOCK_K, BLOCK_N]
        a_s = tl.load(as_rows + kb)
        b_s = tl.load(bs_rows + kb)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_block_gemv_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K, n_kb, stride_wn,
                           stride_wsn, k_per_split, HAS_BIAS: tl.constexpr,
                           SPLIT: tl.constexpr, SCALE_N: tl.constexpr,
                           BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                           GROUP: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    # out[n] = sum over K blocks kb of (xq[kb] . wq[n, kb]) * xs[kb] * ws[n // SCALE_N, kb]
    # for one row x, which each program quantizes per GROUP-wide slice as it walks K
    # (every program does the same arithmetic on the same slice, so they agree).
    # Program (i, j) owns weight rows [i * BLOCK_N, (i + 1) * BLOCK_N), all in one block
    # row of the scale grid (BLOCK_N divides SCALE_N), and the K range
    # [j * k_per_split, (j + 1) * k_per_split), in chunks of GROUPS slices. A slice's
    # dequantized activation is multiplied by its weight block's scale, so the weight
    # takes one product per element, added into a sum per element that each thread keeps
    # and the program reduces once, at the end. With SPLIT the partial sums are added
    # atomically into a zeroed fp32 output.
    CHUNK: tl.constexpr = GROUPS * GROUP
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_c = tl.arange(0, CHUNK)
    offs_g = tl.arange(0, GROUPS)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    ws_row = ws_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_wsn
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, CHUNK), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), CHUNK):
        offs_k = k0 + offs_c
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        kb = k0 // GROUP + offs_g
        ws = tl.load(ws_row + kb, mask=kb < n_kb, other=0.0)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        x = tl.reshape(x.to(tl.float32), [GROUPS, GROUP])
        xs, inv = _scale_of(tl.max(tl.abs(x), axis=1))
        xq = _to_fp8(x * inv[:, None], NATIVE).to(tl.float32)
        acc += w * tl.reshape(xq * (xs * ws)[:, None], [CHUNK])[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid_k == 0:
            out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if SPLIT:
        tl.atomic_add(out_ptr + offs_n, out, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_split(n_programs: int, n_chunks: int, num_sms: int) -> int:
    """K splits of a GEMV launch of ``n_programs`` output tiles, each walking ``n_chunks``
    chunks of K, on ``num_sms`` multiprocessors: 1 when the tiles alone give
    GEMV_MIN_PROGRAMS_PER_SM programs per multiprocessor, else enough splits for that
    (at most one per chunk)."""
    want = GEMV_MIN_PROGRAMS_PER_SM * num_sms
    if n_programs >= want:
        return 1
    return max(1, min(n_chunks, triton.cdiv(want, n_programs)))


def _gemv_launch(n: int, k: int, block_n: int, device: torch.device,
                 split: int | None) -> tuple[int, int, int, int]:
    """(programs along N, splits of K, K columns a split, chunk width) of a one-row GEMV
    over an [n, k] weight; ``split`` None picks the splits by ``gemv_split``."""
    chunk = min(GEMV_CHUNK, max(16, triton.next_power_of_2(k)))
    n_chunks = triton.cdiv(k, chunk)
    tiles = triton.cdiv(n, block_n)
    if split is None:
        split = gemv_split(tiles, n_chunks, num_multiprocessors(device))
    k_per_split = triton.cdiv(n_chunks, split) * chunk
    return tiles, triton.cdiv(k, k_per_split), k_per_split, chunk


def _gemv_output(n: int, dtype: torch.dtype, device: torch.device,
                 split: int) -> torch.Tensor:
    # a split launch adds into zeros, in fp32
    if split > 1:
        return torch.zeros((1, n), dtype=torch.float32, device=device)
    return torch.empty((1, n), dtype=dtype, device=device)


def _launch_block_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, block: tuple[int, int],
                       split: int | None = None) -> torch.Tensor:
    n, k = weight.shape
    group = block[1]
    block_n = min(GEMV_BLOCK_N, block[0] & -block[0])
    tiles, split, k_per_split, chunk = _gemv_launch(n, k, block_n, x.device, split)
    chunk = max(chunk, group)
    k_per_split = triton.cdiv(k_per_split, chunk) * chunk
    out = _gemv_output(n, x.dtype, x.device, split)
    _fp8_block_gemv_kernel[(tiles, split)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, n, k,
        weight_scale.shape[1], weight.stride(0), weight_scale.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SPLIT=split > 1, SCALE_N=block[0], BLOCK_N=block_n,
        GROUPS=chunk // group, GROUP=group, NATIVE=native_fp8(x.device),
        num_warps=GEMV_WARPS, **pdl_args(x.device))
    return out.to(x.dtype) if split > 1 else out


def _gemm_config(m: int, block_scaled: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the fp8 GEMMs for m rows, in 128-wide
    K tiles. Up to 16 rows take one 16-row tile, so each weight tile is read once, in
    32-row tiles on one warp with 6 stages of loads in flight (compiled for sm_90: 2.0
    instructions per weight byte, 31 KiB of shared memory). Longer launches take 32 or
    64-row tiles, then 128 x 128 tiles on 8 warps, except the block-scaled GEMM: it
    scales each K tile's product before adding it, so it holds a second
    accumulator-sized tile, and a 128 x 128 tile takes all 255 registers (64 x 128 on 4
    warps: 200)."""
    if m <= 16:
        return 16, 32, 1, 6
    if m <= 32:
        return 32, 128, 4, 4
    if m <= 64 or block_scaled:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def _launch_block_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    block_m, block_n, warps, stages = _gemm_config(m, block_scaled=True)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_block_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else xs, out, m, n, k,
        xq.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SCALE_N=block[0], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block[1], GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def _check_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  op: str) -> None:
    check_float("x", x, op)
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"{op} needs a {FP8_DTYPE} weight, got {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op} needs x [..., K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"{op} needs the weight contiguous in its last dimension")
    check_same_device("weight", weight, x, "x")
    n = weight.shape[0]
    if bias is not None:
        if bias.shape != (n,) or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
        check_same_device("bias", bias, x, "x")


def _rows(x: torch.Tensor) -> torch.Tensor:
    # x [..., K] as [M, K], contiguous in K
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _check_block_scale(weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: tuple[int, int]) -> None:
    bn, bk = block
    if bn < 1 or bk < 16 or bk & (bk - 1):
        raise ValueError(f"block is (rows >= 1, columns a power of two >= 16), got {block}")
    n, k = weight.shape
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    if (weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != grid
            or weight_scale.stride(1) != 1):
        raise ValueError(f"weight_scale must be a float32 {list(grid)} contiguous in its "
                         f"last dimension for a [{n}, {k}] weight in {bn}x{bk} blocks, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    check_same_device("weight_scale", weight_scale, weight, "weight")


# More rows than this take cuBLAS's block-scaled fp8 GEMM where it runs (``block_scaled_mm``);
# up to it the Triton GEMM's one 16-row tile reads each weight tile once.
BLOCK_SCALED_MM_MIN_ROWS = 17
# cuBLAS's block scaling: 1 x 128 activation groups against 128 x 128 weight blocks
CUBLAS_BLOCK = (128, 128)


def _cublas_block_mm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # torch._scaled_mm with block scales: the activation's [M, K / 128] group scales
    # outer-dimension-major (stride 1 along M), the weight's [N / 128, K / 128] block
    # scales transposed to [K / 128, N / 128], as cuBLAS reads them
    return torch._scaled_mm(xq, weight.t(), xs.t().contiguous().t(), weight_scale.t(),
                            out_dtype=out_dtype)


def block_scaled_mm(device: torch.device) -> str | None:
    """Whether cuBLAS's block-scaled fp8 GEMM (CUDA 12.9 or newer, compute capability 9.0)
    runs on this CUDA device through ``torch._scaled_mm``: tried once a device on small
    products against the Triton block GEMM. "any": any row count; "aligned": row counts
    that are a multiple of 16 (others are padded to one); None: not here (the Triton GEMM
    runs)."""
    return _probe_block_scaled_mm(device.index if device.index is not None
                                  else torch.cuda.current_device())


@functools.cache
def _probe_block_scaled_mm(device_index: int) -> str | None:
    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(256, 384, device=device, generator=gen) * 64).clamp(-448, 448)
    weight = w.to(FP8_DTYPE)
    weight_scale = torch.rand(2, 3, device=device, generator=gen) * 1e-2 + 1e-3
    works = []
    for m in (17, 64):
        x = torch.randn(m, 384, device=device, dtype=torch.bfloat16, generator=gen)
        xq, xs = quant_fp8_per_group(x, 128)
        try:
            out = _cublas_block_mm(xq, xs, weight, weight_scale, torch.bfloat16)
        except (RuntimeError, TypeError, ValueError):  # this torch / cuBLAS refuses it
            works.append(False)
            continue
        ref = _launch_block_gemm(xq, xs, weight, weight_scale, None, CUBLAS_BLOCK,
                                 torch.bfloat16).float()
        err = (out.float() - ref).abs().max() / ref.abs().max()
        works.append(bool(err < 2e-2))
    if all(works):
        return "any"
    return "aligned" if works[1] else None


def _block_mm_mode(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                   block: tuple[int, int]) -> str | None:
    if (m < BLOCK_SCALED_MM_MIN_ROWS or block != CUBLAS_BLOCK or not native_fp8(device)
            or dtype != torch.bfloat16 or n % 128 or k % 128):
        return None
    return block_scaled_mm(device)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``x @ w.T + bias`` for a block-scaled fp8 weight (DeepSeek-V3 / Qwen3-FP8).

    x: [..., K] float32, bfloat16 or float16; weight: fp8 e4m3 [N, K]; weight_scale:
    fp32 [ceil(N / bn), ceil(K / bk)] for ``block = (bn, bk)``, the multiplier of each
    block; bias: [N] or None. N and K need not be multiples of the block. The activation
    is quantized per 1 x bk group (``quant_fp8_per_group``), and the result is
    ``sum_kb (xq[:, kb] @ wq[:, kb].T) * xs[:, kb] * ws[n // bn, kb]`` accumulated in
    fp32, plus the bias, rounded once to x's dtype: [..., N].

    Paths: one row takes one GEMV launch, which quantizes x itself and streams the
    weight once (splitting K when N is short); more rows take the quantization kernel and
    a ``tl.dot`` GEMM on fp8 tiles with bk-wide K tiles (up to 16 rows in one row tile,
    so that it too reads the weight once), or, for more than 16 bfloat16 rows of a
    128 x 128-block weight whose N and K are multiples of 128, cuBLAS's block-scaled GEMM
    where this device runs it (``block_scaled_mm``).
    """
    _check_weight(x, weight, bias, "fp8_block_linear")
    block = (int(block[0]), int(block[1]))
    _check_block_scale(weight, weight_scale, block)
    lead = x.shape[:-1]
    x2 = _rows(x)
    m, n = x2.shape[0], weight.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros((*lead, n))
    if m == 1:
        out = _launch_block_gemv(x2, weight, weight_scale, bias, block)
        return out.reshape(*lead, n)
    mode = _block_mm_mode(m, n, x2.shape[1], x.dtype, x.device, block)
    if mode == "aligned" and m % 16:
        x2 = torch.cat([x2, x2.new_zeros(16 - m % 16, x2.shape[1])])
    xq, xs = quant_fp8_per_group(x2, block[1])
    if mode is None:
        out = _launch_block_gemm(xq, xs, weight, weight_scale, bias, block, x.dtype)
    else:
        out = _cublas_block_mm(xq, xs, weight, weight_scale, x.dtype)[:m]
        if bias is not None:
            out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)


# ---- per-tensor / per-channel scaled linear --------------------------------------------

@triton.jit
def _fp8_channel_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K,
                             stride_wn, ws_stride, k_per_split, STATIC_SCALE: tl.constexpr,
                             HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_A: tl.constexpr, NATIVE: tl.constexpr,
                             PDL: tl.constexpr):
    # out[n] = (xq . wq[n]) * xs * ws[n] for one row x, which each program quantizes
    # itself: with the static scale at xs_ptr, or with the row's amax from a first pass
    # over it (in L2; for one row per-token and per-tensor scales are the same).
    # ws_stride is 0 for a per-tensor weight scale. Program (i, j) owns weight rows
    # [i * BLOCK_N, (i + 1) * BLOCK_N) and the K range [j * k_per_split,
    # (j + 1) * k_per_split); each thread keeps a sum per weight element it holds, reduced
    # once at the end; with SPLIT the partial sums are added atomically into a zeroed
    # fp32 output.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    pdl_wait(PDL)
    if STATIC_SCALE:
        xs = tl.load(xs_ptr)
        inv = _recip(xs)
    else:
        offs_a = tl.arange(0, BLOCK_A)
        row_max = tl.zeros((BLOCK_A,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_A):
            xa = tl.load(x_ptr + k0 + offs_a, mask=k0 + offs_a < K, other=0.0)
            row_max = tl.maximum(row_max, tl.abs(xa.to(tl.float32)))
        xs, inv = _scale_of(tl.max(row_max, axis=0))
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
        xq = _to_fp8(x.to(tl.float32) * inv, NATIVE).to(tl.float32)
        acc += w * xq[None, :]
    ws = tl.load(ws_ptr + offs_n * ws_stride, mask=n_ok, other=0.0)
    out = tl.sum(acc, axis=1) * xs * ws
    if HAS_BIAS:  # noqa: SIM102 - a compile-time branch around a run-time one
        if pid_k == 0:
            out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if SPLIT:
        tl.atomic_add(out_ptr + offs_n, out, mask=n_ok)
    else:
        tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_channel_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                             stride_am, as_stride, stride_bn, bs_stride, stride_cm,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr):
    # C = (A @ B.T) * a_scale[m] * b_scale[n]; a scale stride of 0 broadcasts a
    # per-tensor scale. Tile order as in _fp8_block_gemm_kernel.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows_a = tl.minimum(offs_m, M - 1)  # as in _fp8_block_gemm_kernel: only K is masked
    rows_b = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_tile = b_ptr + rows_b[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=offs_k[None, :] < K - k0, other=0.0)
        b = tl.load(b_tile, mask=offs_k[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K
        b_tile += BLOCK_K
    a_s = tl.load(as_ptr + offs_m * as_stride, mask=m_ok, other=0.0)
    b_s = tl.load(bs_ptr + offs_n * bs_stride, mask=n_ok, other=0.0)
    acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_channel_gemv(x: torch.Tensor, input_scale: torch.Tensor | None,
                         weight: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                         split: int | None = None) -> torch.Tensor:
    n, k = weight.shape
    tiles, split, k_per_split, chunk = _gemv_launch(n, k, GEMV_BLOCK_N, x.device, split)
    out = _gemv_output(n, x.dtype, x.device, split)
    _fp8_channel_gemv_kernel[(tiles, split)](
        x, input_scale if input_scale is not None else ws, weight, ws,
        bias if bias is not None else ws, out, n, k, weight.stride(0),
        1 if ws.numel() > 1 else 0, k_per_split, STATIC_SCALE=input_scale is not None,
        HAS_BIAS=bias is not None, SPLIT=split > 1, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=chunk,
        BLOCK_A=min(2048, triton.next_power_of_2(k)), NATIVE=native_fp8(x.device),
        num_warps=GEMV_WARPS, **pdl_args(x.device))
    return out.to(x.dtype) if split > 1 else out


def _launch_channel_gemm(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                         ws: torch.Tensor, bias: torch.Tensor | None,
                         out_dtype: torch.dtype) -> torch.Tensor:
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    block_m, block_n, warps, stages = _gemm_config(m, block_scaled=False)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_channel_gemm_kernel[grid](
        xq, xs, weight, ws, bias if bias is not None else ws, out, m, n, k, xq.stride(0),
        1 if xs.numel() > 1 else 0, weight.stride(0), 1 if ws.numel() > 1 else 0,
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=128, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def _weight_scale_vector(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    # a one-element scale as [1], a per-channel one ([N, 1] or [N]) as a contiguous [N]
    n = weight.shape[0]
    if weight_scale.dtype != torch.float32 or weight_scale.numel() not in (1, n) or (
            weight_scale.numel() == n and n > 1
            and tuple(weight_scale.shape) not in ((n,), (n, 1))):
        raise ValueError(f"weight_scale must be float32 with one element, or [{n}, 1], got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    check_same_device("weight_scale", weight_scale, weight, "weight")
    return weight_scale.reshape(-1).contiguous()


def scaled_linear_path(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                       rowwise: bool) -> str:
    """Which path ``fp8_scaled_linear`` takes for x [m, k] of ``dtype`` on ``device`` and
    an [n, k] weight; ``rowwise``: the activation or the weight scale has more than one
    element. "gemv": the Triton GEMV (one row, any device); "scaled_mm":
    ``torch._scaled_mm`` (a CUDA GPU of compute capability 8.9 or newer, k and n multiples
    of 16, a bfloat16 output, or float16 with both scales one-element); "gemm": the
    Triton GEMM otherwise."""
    if m == 1:
        return "gemv"
    if (native_fp8(device) and torch.cuda.get_device_capability(device) >= (8, 9)
            and k % 16 == 0 and n % 16 == 0
            and dtype in ((torch.bfloat16,) if rowwise else (torch.bfloat16, torch.float16))):
        return "scaled_mm"
    return "gemm"


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, *,
                      dynamic: str = "per_token") -> torch.Tensor:
    """``x @ w.T + bias`` for an fp8 weight with a per-tensor or per-channel scale.

    x: [..., K] float32, bfloat16 or float16; weight: fp8 e4m3 [N, K]; weight_scale: fp32
    with one element, or per output channel [N, 1] (or [N]); input_scale: a one-element
    fp32 tensor for static per-tensor activation scaling, or None for a dynamic scale,
    ``dynamic="per_token"`` (one per row, the default) or ``"per_tensor"``; bias: [N] or
    None. The activation is quantized as ``quant_fp8_per_tensor`` / ``quant_fp8_per_token``
    do, and the result is ``(xq @ wq.T) * xs * ws`` accumulated in fp32, plus the bias,
    in x's dtype: [..., N].

    Prefer (``scaled_linear_path``): one row (decode) takes a Triton GEMV that quantizes
    x itself, in one launch, and streams the weight once; more rows are quantized by the
    Triton kernels, then on a CUDA GPU with K and N multiples of 16 and a bfloat16 output
    (or float16 with both scales one-element) multiplied by
    ``torch._scaled_mm(xq, weight.t(), scale_a, scale_b, bias, out_dtype=x.dtype)``: the
    weight transposed is the column-major operand it needs, and the scales are both
    one-element (tensor-wise) or [M, 1] and [1, N] (row-wise; a one-element scale on one
    side is expanded to match). Other shapes, float32 outputs and the CPU take the
    Triton fp8 GEMM (up to 16 rows in one row tile). The weight is never dequantized.
    """
    _check_weight(x, weight, bias, "fp8_scaled_linear")
    ws = _weight_scale_vector(weight, weight_scale)
    if input_scale is None:
        if dynamic not in _DYNAMIC:
            raise ValueError(f"dynamic must be 'per_token' or 'per_tensor', got {dynamic!r}")
    elif input_scale.numel() != 1 or input_scale.dtype != torch.float32:
        raise ValueError(f"input_scale must be one float32 element, got "
                         f"{input_scale.dtype} {tuple(input_scale.shape)}")
    else:
        check_same_device("input_scale", input_scale, x, "x")
    per_token = input_scale is None and dynamic == "per_token"
    lead = x.shape[:-1]
    x2 = _rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros((*lead, n))
    rowwise = per_token or ws.numel() > 1
    path = scaled_linear_path(m, n, k, x.dtype, x.device, rowwise)
    if path == "gemv":
        return _launch_channel_gemv(x2, input_scale, weight, ws, bias).reshape(*lead, n)
    if per_token:
        xq, xs = quant_fp8_per_token(x2)
    else:
        xq, xs = quant_fp8_per_tensor(x2, input_scale)
    if path == "gemm":
        out = _launch_channel_gemm(xq, xs, weight, ws, bias, x.dtype)
        return out.reshape(*lead, n)
    if rowwise:  # [M, 1] and [1, N], contiguous
        scale_a = xs.reshape(-1, 1).expand(m, 1).contiguous()
        scale_b = ws.reshape(1, -1).expand(1, n).contiguous()
    else:
        scale_a, scale_b = xs.reshape(()), ws.reshape(())
    out = torch._scaled_mm(xq, weight.t(), scale_a, scale_b,
                           bias=bias.to(x.dtype) if bias is not None else None,
                           out_dtype=x.dtype)
    return out.reshape(*lead, n)


# ---- PyTorch references ---------------------------------------------------------------

def _quantize_ref(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    inv = torch.div(1.0, scale)
    return (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _dynamic_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=AMAX_FLOOR) / FP8_MAX


def quant_fp8_per_tensor_ref(x: torch.Tensor, scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``quant_fp8_per_tensor``."""
    xf = x.float()
    if scale is None:
        scale = _dynamic_scale_ref(xf.abs().amax().reshape(1))
    return _quantize_ref(xf, scale.reshape(()).float()), scale


def quant_fp8_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``quant_fp8_per_token``."""
    xf = x.float()
    scale = _dynamic_scale_ref(xf.abs().amax(dim=1, keepdim=True))
    return _quantize_ref(xf, scale), scale


def quant_fp8_per_group_ref(x: torch.Tensor, group: int = 128
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``quant_fp8_per_group``."""
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    xf = torch.zeros((m, n_groups * group), dtype=torch.float32, device=x.device)
    xf[:, :k] = x.float()
    xf = xf.view(m, n_groups, group)
    scale = _dynamic_scale_ref(xf.abs().amax(dim=2))
    xq = _quantize_ref(xf, scale[:, :, None]).view(m, -1)[:, :k].contiguous()
    return xq, scale


def dequantize_fp8_block(weight: torch.Tensor, weight_scale: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The fp32 [N, K] matrix a block-scaled fp8 weight stands for (references, tests)."""
    n, k = weight.shape
    scale = weight_scale.repeat_interleave(block[0], 0)[:n]
    return weight.float() * scale.repeat_interleave(block[1], 1)[:, :k]


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """PyTorch reference for ``fp8_block_linear``: x quantized per 1 x bk group as the
    kernels do, both operands dequantized in fp32, one fp32 matmul, bias, x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = quant_fp8_per_group_ref(x2, block[1])
    k = x2.shape[1]
    x_deq = xq.float() * xs.repeat_interleave(block[1], 1)[:, :k]
    out = x_deq @ dequantize_fp8_block(weight, weight_scale, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, weight.shape[0])


def fp8_scaled_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          input_scale: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None, *,
                          dynamic: str = "per_token") -> torch.Tensor:
    """PyTorch reference for ``fp8_scaled_linear``: the same activation quantization,
    both operands dequantized in fp32, one fp32 matmul, bias, x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None and dynamic == "per_token":
        xq, xs = quant_fp8_per_token_ref(x2)
    else:
        xq, xs = quant_fp8_per_tensor_ref(x2, input_scale)
    ws = weight_scale.reshape(-1).float()
    w_deq = weight.float() * (ws[:, None] if ws.numel() > 1 else ws)
    out = (xq.float() * xs.reshape(-1, 1)) @ w_deq.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, weight.shape[0])
