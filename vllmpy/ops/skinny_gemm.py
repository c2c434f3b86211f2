"""``x @ w.T`` for the few rows of a decode step: a weight-streaming kernel.

With a handful of rows the product is a read of the weight matrix, so the kernel is built
to stream it: each program owns ``BLOCK_N`` output columns (weight rows), walks the whole
reduction in ``BLOCK_K`` chunks with the loads pipelined, and keeps the few activation rows
in registers. Accumulation is in fp32 and each output is rounded once, as cuBLAS does.
The PyTorch reference is ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float, check_same_device

# The kernel takes up to this many rows. Measured on the H200 it beats cuBLAS for one row
# only (docs/BENCHMARKS.md), which is where the linear layers use it.
MAX_ROWS = 8


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        for m in tl.static_range(BLOCK_M):
            # rows past M (BLOCK_M is a power of two) re-read the last row; never stored
            row = tl.minimum(m, M - 1)
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=k_ok, other=0.0)
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [M, K] with M <= MAX_ROWS; weight [N, K]
    contiguous. Returns a new [M, N] tensor of x's dtype."""
    check_float("x", x, "skinny_gemm")
    check_float("weight", weight, "skinny_gemm")
    check_same_device("weight", weight, x, "x")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_gemm needs x [M, K] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_gemm needs x and weight contiguous in their last dimension")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    # The best launch of the sweep (benchmarks/skinny_gemm_sweep.py) for every decode
    # GEMM of the benchmark configs, within a few percent.
    _launch(x, weight, bias, out, block_n=8, block_k=512, num_warps=4, num_stages=3)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, block_n: int, block_k: int, num_warps: int,
            num_stages: int) -> None:
    m, k = x.shape
    n = weight.shape[0]
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(m)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
