"""``x @ w.T`` for the few rows of a decode step: a weight-streaming kernel, which can also
take the step before it into its prologue.

With a handful of rows the product is a read of the weight matrix, so the kernel is built
to stream it: each program owns ``BLOCK_N`` output columns (weight rows), walks the whole
reduction in ``BLOCK_K`` chunks with the loads pipelined, and keeps the few activation rows
in registers. A small weight is taken in one wave instead, each program loading its whole
share as one chunk before it waits for the kernel before it (``whole_share_rows``).
Accumulation is in fp32 and each output is rounded once, as cuBLAS does.

The elementwise step that feeds a decoder's linear layer can run inside the same launch,
on the activation chunk each program loads anyway; a one-row decode then takes one kernel
where it took two:

- ``rms_norm_gemm``: ``linear(rms_norm(x + residual))``, also returning ``x + residual``
  (the qkv and gate_up projections after their layer norms); program 0 stores the sum.
  Every program needs the row's norm. A launch of many chunks computes it first, from the
  whole row (in L2), and then rounds the normalized chunks where ``rms_norm`` rounds. A
  launch of few chunks, or a one-row launch whose whole grid runs at once (``folds_norm``),
  folds it instead: since
  ``sum_k w[k] * nw[k] * x[k] / rms = (sum_k w[k] * nw[k] * x[k]) / rms``, it sums the
  squares of the chunks it loads anyway and scales its fp32 sums once at the end, so
  nothing stands between the wait for the kernel before and the first product. The
  normalized activations are then not rounded to the model's dtype (twice, as
  ``rms_norm`` rounds them): in bfloat16 that moves each term of the sum by at most 2^-7
  of itself, and the output is rounded once, as always.
- ``silu_mul_gemm``: ``linear(silu(gate) * up)`` (the down projection).

An fp8 (e4m3) weight streams the same way in half the bytes, with its scales
(``WeightScale``): each code is widened and multiplied by the activation, which first
takes the scale of the weight block it meets (block scales: a program's rows share one
block row), or each row's sum takes the row's scale at the end (per-row and per-tensor
scales). The activation itself is not quantized: the arithmetic is W8A16's, so a decode
step loses nothing to an e4m3 activation (vLLM's Marlin fp8 kernels do the same).

Otherwise they round where the unfused kernels round (``vllmpy.ops.fused``), so they give
the same values up to the order of the fp32 sums. The PyTorch references are the layers'
own functions followed by ``torch.nn.functional.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device
from vllmpy.ops.native import rms_norm_torch, silu_and_mul_torch
from vllmpy.ops.paged_attention import num_multiprocessors
from vllmpy.ops.pdl import pdl_args, pdl_wait

# The kernel takes up to this many rows; it beats cuBLAS for one row only, which is where
# the linear layers use it (docs/perf-log/gpu-dense.md, "persistent batch, skinny GEMM").
MAX_ROWS = 8

# what a program does to its activation chunk before the product
PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class WeightScale:
    """The multipliers of an fp8 weight's stored values: ``scale`` float32 [N] (or [N, 1]),
    one per weight row (a per-tensor scale repeated over its rows), with ``block`` None;
    or [ceil(N / bn), ceil(K / bk)], one per ``block = (bn, bk)`` tile."""

    scale: torch.Tensor
    block: tuple[int, int] | None = None


@triton.jit
def _accumulate(acc, ssq, w, offs_k, k_ok, x_ptr, res_ptr, nw_ptr, sum_ptr, ws_row, rstd,
                offs_m, M, K, stride_xm, stride_rm, store_sum, NORM: tl.constexpr,
                SILU: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FOLD: tl.constexpr,
                BLOCK_M: tl.constexpr, SQ_VEC: tl.constexpr, ROW_VEC: tl.constexpr,
                ROW_GROUP: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                SCALE_K: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] += (the activation chunk at offs_k, prologue applied) @ w.T,
    # or with ROW_VEC (one row) acc [BLOCK_N, BLOCK_K // ROW_GROUP] += the products summed
    # over groups of ROW_GROUP neighbouring columns, which one thread holds: no chunk sums
    # across the program's threads, the caller reduces acc once at the end;
    # with FOLD the norm's weight is applied here, and the caller scales by 1 / rms at the
    # end, from the squares summed into ssq as the chunks pass: [BLOCK_M] sums, or with
    # SQ_VEC (one row) a [BLOCK_K] vector of per-position sums, so that a chunk adds its
    # squares without a reduction across the program's threads;
    # with BLOCK_SCALES each activation is multiplied by the scale of the weight
    # block it meets (the program's rows share one block row, ws_row), so the weight still
    # takes one product per element
    dtype = x_ptr.dtype.element_ty
    if NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if BLOCK_SCALES:
        kscale = tl.load(ws_row + offs_k // SCALE_K, mask=k_ok, other=0.0)
    for m in tl.static_range(BLOCK_M):
        # rows past M (BLOCK_M is a power of two) re-read the last row; never stored
        row = tl.minimum(m, M - 1)
        x = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_ok, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + row * stride_rm + offs_k, mask=k_ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if FOLD:  # noqa: SIM102 - a compile-time branch around a run-time one
                    if store_sum:  # program 0 stores the sum
                        tl.store(sum_ptr + row * K + offs_k, x, mask=k_ok)
            if FOLD:
                xf = x.to(tl.float32)
                if SQ_VEC:  # one row: each thread sums its own squares, reduced at the end
                    ssq += xf * xf
                else:
                    ssq = tl.where(offs_m == m, ssq + tl.sum(xf * xf, axis=0), ssq)
                x = nw * xf
            else:
                inv = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
                x = (nw * (x.to(tl.float32) * inv).to(dtype).to(tl.float32)).to(dtype)
        if SILU:
            # gate in the first K columns, up in the next K; silu rounded as F.silu
            up = tl.load(x_ptr + row * stride_xm + K + offs_k, mask=k_ok, other=0.0)
            g = x.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            x = (act * up.to(tl.float32)).to(dtype)
        if BLOCK_SCALES:
            x = x.to(tl.float32) * kscale
        if ROW_VEC:  # one row: each thread adds its products into its own sums
            prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
            acc += tl.sum(tl.reshape(prod, [w.shape[0], w.shape[1] // ROW_GROUP, ROW_GROUP]),
                          axis=2)
        else:
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    return acc, ssq


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, res_ptr, nw_ptr, sum_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_rm, stride_wn, stride_wsn, stride_om, eps,
    ROW_SCALES: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, FOLD: tl.constexpr, SQ_VEC: tl.constexpr,
    ROW_VEC: tl.constexpr, ROW_GROUP: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    ws_row = ws_ptr + (pid * BLOCK_N // SCALE_N) * stride_wsn  # block scales: rows share it
    # No kernel writes the weights: the first tile loads before waiting for the previous
    # kernel (see vllmpy.ops.pdl), overlapping its tail.
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    pdl_wait(PDL)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SQ_VEC:
        ssq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    else:
        ssq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if NORM and not FOLD:
        # each row's 1 / rms over all K, from the whole row (BLOCK_H >= K); the names here
        # are not reused below, where the tiles have another shape
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < K
        for mm in tl.static_range(BLOCK_M):
            whole_row = tl.minimum(mm, M - 1)
            whole = tl.load(x_ptr + whole_row * stride_xm + cols, mask=col_ok, other=0.0)
            if HAS_RESIDUAL:
                whole_res = tl.load(res_ptr + whole_row * stride_rm + cols, mask=col_ok,
                                    other=0.0)
                whole = (whole.to(tl.float32) + whole_res.to(tl.float32)).to(dtype)
                if pid == 0:
                    tl.store(sum_ptr + whole_row * K + cols, whole, mask=col_ok)
            whole_f = whole.to(tl.float32)
            row_inv = tl.math.rsqrt(tl.sum(whole_f * whole_f, axis=0) / K + eps)
            rstd = tl.where(offs_m == mm, row_inv, rstd)
    if ROW_VEC:
        acc = tl.zeros((BLOCK_N, BLOCK_K // ROW_GROUP), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc, ssq = _accumulate(acc, ssq, w, offs_k, k_ok, x_ptr, res_ptr, nw_ptr, sum_ptr, ws_row,
                           rstd, offs_m, M, K, stride_xm, stride_rm, pid == 0, NORM, SILU,
                           HAS_RESIDUAL, FOLD, BLOCK_M, SQ_VEC, ROW_VEC, ROW_GROUP,
                           BLOCK_SCALES, SCALE_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc, ssq = _accumulate(acc, ssq, w, offs_k, k_ok, x_ptr, res_ptr, nw_ptr, sum_ptr,
                               ws_row, rstd, offs_m, M, K, stride_xm, stride_rm, pid == 0,
                               NORM, SILU, HAS_RESIDUAL, FOLD, BLOCK_M, SQ_VEC, ROW_VEC,
                               ROW_GROUP, BLOCK_SCALES, SCALE_K)
    if ROW_VEC:
        acc = tl.sum(acc, axis=1)[None, :]
    if ROW_SCALES:  # a scale per weight row
        acc *= tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if NORM and FOLD:
        if SQ_VEC:
            acc *= tl.math.rsqrt(tl.sum(ssq, axis=0) / K + eps)
        else:
            acc *= tl.math.rsqrt(ssq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           k: int | None, op: str) -> None:
    """x [M, *] with M <= MAX_ROWS, weight [N, k], both contiguous in their last dimension;
    k None: x is not 2-D, which is refused."""
    check_float("x", x, op)
    if weight.dtype != FP8:
        check_float("weight", weight, op)
    check_same_device("weight", weight, x, "x")
    if k is None or weight.dim() != 2 or weight.shape[1] != k:
        size = "K" if k is None else k
        raise ValueError(f"{op} needs x [M, {size}] and weight [N, {size}], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op} takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{op} needs x and weight contiguous in their last dimension")
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def _check_scale(weight: torch.Tensor, scale: WeightScale | None, op: str) -> None:
    """An fp8 weight comes with its scales, a float weight without them (``WeightScale``)."""
    if scale is None:
        if weight.dtype == FP8:
            raise ValueError(f"{op}: an fp8 weight needs its weight_scale")
        return
    if weight.dtype != FP8:
        raise ValueError(f"{op}: weight_scale is for fp8 weights, not {weight.dtype}")
    t = scale.scale
    check_same_device("weight_scale", t, weight, "weight")
    n, k = weight.shape
    if scale.block is None:
        if t.dtype != torch.float32 or t.numel() != n or t.stride(0) != 1:
            raise ValueError(f"{op}: a per-row weight_scale must be a contiguous float32 "
                             f"[{n}] (or [{n}, 1]), got {t.dtype} {tuple(t.shape)}")
        return
    bn, bk = scale.block
    grid = (-(-n // bn), -(-k // bk))
    if t.dtype != torch.float32 or tuple(t.shape) != grid or t.stride(1) != 1:
        raise ValueError(f"{op}: block weight_scale must be a float32 {list(grid)} "
                         f"contiguous in its last dimension for a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks, got {t.dtype} {tuple(t.shape)}")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: WeightScale | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] with M <= MAX_ROWS; weight [N, K]
    contiguous (fp8 with its ``scale``). Returns a new [M, N] tensor of x's dtype."""
    _check(x, weight, bias, x.shape[1] if x.dim() == 2 else None, "skinny_gemm")
    _check_scale(weight, scale, "skinny_gemm")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, weight, bias, out, PLAIN, 0.0, scale=scale)
    return out


def rms_norm_gemm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: WeightScale | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(s), weight, bias), s)`` for ``s = x + residual`` (rounded to x's
    dtype), or ``s = x`` without a residual. x, residual: [M, K], M <= MAX_ROWS;
    norm_weight: [K] of x's dtype. The sum is a new tensor (x itself without a residual)."""
    _check(x, weight, bias, x.shape[1] if x.dim() == 2 else None, "rms_norm_gemm")
    _check_scale(weight, scale, "rms_norm_gemm")
    k = x.shape[1]
    if norm_weight.shape != (k,) or norm_weight.stride(0) != 1 or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must be a contiguous [{k}] of {x.dtype}, got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    check_same_device("norm_weight", norm_weight, x, "x")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}) and be "
                             f"contiguous in its last dimension, got {residual.dtype} "
                             f"{tuple(residual.shape)}")
        check_same_device("residual", residual, x, "x")
    total = x if residual is None else torch.empty((x.shape[0], k), dtype=x.dtype,
                                                   device=x.device)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, residual, norm_weight, total, weight, bias, out, RMS_NORM, eps, scale=scale)
    return out, total


def silu_mul_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: WeightScale | None = None) -> torch.Tensor:
    """``F.linear(silu(x[:, :K]) * x[:, K:], weight, bias)`` for x [M, 2K] (gate then up),
    M <= MAX_ROWS, and weight [N, K]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul_gemm needs x [M, 2 * K], got {tuple(x.shape)}")
    _check(x, weight, bias, x.shape[1] // 2, "silu_mul_gemm")
    _check_scale(weight, scale, "silu_mul_gemm")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, weight, bias, out, SILU_MUL, 0.0, scale=scale)
    return out


# Small weights (Qwen3-0.6B's qkv, o and down projections) launch one wave of programs,
# each taking its whole share of the weight in one tile that it loads before waiting for
# the kernel before it (vllmpy.ops.pdl): the weight streams while attention or the
# previous GEMM finishes. A share is at most WHOLE_SHARE_ELEMS weights (32 KiB of bfloat16,
# about 128 registers a thread on WHOLE_SHARE_WARPS warps, so that two programs fit on a
# multiprocessor) and the grid at most WHOLE_SHARE_WAVES programs per multiprocessor:
# larger shares and denser grids were slower (docs/perf-log/gpu-dense.md, "loads moved
# ahead of the PDL wait").
WHOLE_SHARE_ELEMS = 16384
WHOLE_SHARE_WARPS = 8
WHOLE_SHARE_WAVES = 2


def whole_share_rows(n: int, k: int, num_sms: int) -> int | None:
    """Weight rows per program for the whole-share launch of an [n, k] weight on
    ``num_sms`` multiprocessors: the fewest rows (a power of two) that keep the grid within
    one program per multiprocessor, else the most that fit a share, if those keep it
    within WHOLE_SHARE_WAVES; None when the weight is too large for that (the launch then
    streams it in chunks)."""
    k_pad = triton.next_power_of_2(k)
    rows = WHOLE_SHARE_ELEMS // k_pad
    if rows < 1:
        return None
    rows = 1 << (rows.bit_length() - 1)
    if triton.cdiv(n, rows) > WHOLE_SHARE_WAVES * num_sms:
        return None
    while rows > 1 and triton.cdiv(n, rows // 2) <= num_sms:
        rows //= 2
    return rows


# A norm launch of at most this many chunks folds the norm into its sums (module
# docstring); in longer streams the squares' work in every chunk costs more than the
# prologue it saves (docs/perf-log/gpu-dense.md, "a folded norm for short one-row launches").
FOLD_MAX_CHUNKS = 2
# A one-row launch of more chunks folds too when its grid has at most this many programs
# per multiprocessor, so that every program runs at once and each one's whole-row
# prologue would sit on the launch's critical path; its chunks then add their squares
# without a reduction (SQ_VEC). A grid of several waves keeps the prologue: its later
# waves' prologues overlap earlier streams (docs/perf-log/gpu-dense.md, "a one-row norm
# launch that runs in one wave folds its norm").
FOLD_MAX_PROGRAMS_PER_SM = 8


def folds_norm(m: int, n: int, k: int, block_n: int, block_k: int, num_sms: int) -> bool:
    """Whether a norm launch of m rows over an [n, k] weight, in [block_n, block_k] tiles on
    ``num_sms`` multiprocessors, folds the norm into its sums (module docstring)."""
    if triton.cdiv(k, block_k) <= FOLD_MAX_CHUNKS:
        return True
    return m == 1 and triton.cdiv(n, block_n) <= FOLD_MAX_PROGRAMS_PER_SM * num_sms


# A one-row launch of more than one chunk keeps each thread's products in its own fp32
# sums, ROW_GROUP neighbouring columns added first, and reduces them across the program
# once, at the end, where a launch of more rows sums every chunk across the program's
# threads. Its chunk loop then holds no shuffle, and no barrier but the activation's; the
# norm launches gain from it only with the wider chunks of ``norm_launch``
# (docs/perf-log/gpu-dense.md, "one-row launches keep per-thread sums").
ROW_GROUP = 8
# A one-row norm launch whose K is at least NORM_WIDE_K streams wider chunks: a grid that
# runs in one wave (Qwen3-8B's qkv projection: 768 programs) 1024-wide chunks on 4 warps,
# a larger one (its gate_up: 3,072 programs) 2048-wide chunks on 8 warps, which fold the
# norm at K = 4,096 (2 chunks): the fastest shapes with the per-thread sums above (same log).
NORM_WIDE_K = 4096
# A one-row SiLU launch (a down projection) streams 2048-wide chunks, once the norm
# launches take wide ones (same log).
SILU_ONE_ROW_K = 2048


def norm_launch(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int]:
    """(rows a program, chunk width, warps) of a streamed norm launch of m rows over an
    [n, k] weight on ``num_sms`` multiprocessors."""
    if m == 1 and k >= NORM_WIDE_K:
        if triton.cdiv(n, 8) <= FOLD_MAX_PROGRAMS_PER_SM * num_sms:
            return 8, 1024, 4
        return 8, 2048, 8
    return 8, 512, 4


def _launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
            total: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, prologue: int, eps: float, block_n: int | None = None,
            block_k: int | None = None, num_warps: int | None = None,
            num_stages: int = 3, scale: WeightScale | None = None) -> None:
    m = x.shape[0]
    n, k = weight.shape
    if m == 0 or n == 0:
        return
    num_sms = num_multiprocessors(x.device)
    if block_n is None:
        rows = whole_share_rows(n, k, num_sms)
        if rows is not None:  # a small matrix: one tile per program, loaded up front
            block_n, block_k = rows, triton.next_power_of_2(k)
            num_warps, num_stages = WHOLE_SHARE_WARPS, 1
    # Otherwise one launch shape per prologue, the best of a sweep with cold weights
    # (docs/perf-log/gpu-dense.md, "one-row decode fusions"): the norm prologue 8 rows in
    # 512-wide chunks on 4 warps (long one-row launches: ``norm_launch``); SiLU (long K)
    # 1024-wide chunks on 8 warps (one row: SILU_ONE_ROW_K); a plain GEMM (o_proj) 2 rows
    # per program in 1024-wide chunks, for 4x the programs in flight.
    if block_n is None and prologue == RMS_NORM:
        block_n, block_k, num_warps = norm_launch(m, n, k, num_sms)
    if block_n is None:
        block_n = 2 if prologue == PLAIN else 8
    if block_k is None:
        block_k = SILU_ONE_ROW_K if prologue == SILU_MUL and m == 1 else 1024
    if num_warps is None:
        num_warps = 8 if prologue == SILU_MUL else 4
    blocks = scale is not None and scale.block is not None
    scale_n, scale_k = scale.block if blocks else (1, 1)  # type: ignore[union-attr,misc]
    if blocks:  # a program's rows in one block row of the scales
        block_n = min(block_n, scale_n & -scale_n)
    fold = prologue == RMS_NORM and folds_norm(m, n, k, block_n, block_k, num_sms)
    row_vec = m == 1 and block_k >= ROW_GROUP and triton.cdiv(k, block_k) > 1
    ws = scale.scale if scale is not None else weight
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        total if total is not None else out, weight, ws, bias if bias is not None else weight,
        out, m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0,
        weight.stride(0), ws.stride(0) if blocks else 0, out.stride(0), eps,
        ROW_SCALES=scale is not None and not blocks, BLOCK_SCALES=blocks, SCALE_N=scale_n,
        SCALE_K=scale_k, NORM=prologue == RMS_NORM, SILU=prologue == SILU_MUL,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_H=triton.next_power_of_2(k) if prologue == RMS_NORM and not fold else 1,
        FOLD=fold, SQ_VEC=fold and m == 1, ROW_VEC=row_vec, ROW_GROUP=ROW_GROUP,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device),
    )


def rms_norm_gemm_ref(x: torch.Tensor, residual: torch.Tensor | None,
                      norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference for ``rms_norm_gemm``: the RMSNorm layer's math, then the linear."""
    total = x if residual is None else x + residual
    return F.linear(rms_norm_torch(total, norm_weight, eps), weight, bias), total


def silu_mul_gemm_ref(x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference for ``silu_mul_gemm``: SiluAndMul's math, then the linear."""
    return F.linear(silu_and_mul_torch(x), weight, bias)
