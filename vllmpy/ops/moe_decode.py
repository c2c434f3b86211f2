"""The experts of a MoE layer for a decode step's few tokens, as two one-row kernels.

A decode step routes T tokens to k experts each, T * k pairs of a few dozen at most. The
grouped GEMMs of ``vllmpy.ops.fused_moe`` sort those pairs by expert and pad each expert's
run to a 16-row tile, so nearly every row they multiply is padding, and the sort is a
launch of its own. Here no pair is sorted or padded:

1. ``_gate_up_rows_kernel``: one program per (pair, tile of I columns) reads its token's
   row of x and its expert's gate and up rows, and stores act(gate, up) for the pair:
   inter [T * k, I] in x's dtype (rounded as the reference rounds it).
2. ``_down_rows_kernel``: one program per (token, tile of H columns) runs over the token's
   k pairs, each pair's down product (plus its bias) times its routing weight, summed in
   fp32 and stored once in x's dtype: no per-pair buffer and no separate sum.

Each program reads only the chosen experts' rows, every size is fixed by T, k and the
weights' shapes, and nothing is read back to the host: a decode step stays capturable in
a CUDA graph. Products are fp32 multiply-adds of the loaded values (a reduction over K,
not a tensor-core dot).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# at most this many (token, expert) pairs take these kernels (a decode step's batch)
DECODE_PAIRS = 64

# launch shape: rows of a weight tile and the K depth a program reads per step
GATE_UP_BLOCK_N = 4
DOWN_BLOCK_N = 8
BLOCK_K = 512
NUM_WARPS = 4


@triton.jit
def _gate_up_rows_kernel(x_ptr, w_ptr, bias_ptr, ids_ptr, out_ptr, top_k, H, inter,
                         stride_xm, stride_we, stride_wn, stride_be, stride_om, alpha, limit,
                         s_ptr, stride_se, stride_sn, stride_sk, scale_n, scale_k, up_row0,
                         HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr, FP8: tl.constexpr,
                         K_BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    token = pair // top_k
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    w_base = w_ptr + expert * stride_we
    gate_rows = w_base + offs_n[:, None].to(tl.int64) * stride_wn
    up_rows = w_base + (offs_n + inter)[:, None].to(tl.int64) * stride_wn
    if FP8:  # each row's scale row in the grid: gate blocks, then up blocks
        s_base = s_ptr + expert * stride_se
        gate_scales = s_base + (offs_n // scale_n) * stride_sn
        up_scales = s_base + (up_row0 + offs_n // scale_n) * stride_sn
    gate_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < H
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
        wu = tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if K_BLOCKED:  # a K tile lies inside one scale block
            k_col = (k0 // scale_k) * stride_sk
            wg = wg * tl.load(gate_scales + k_col, mask=n_ok, other=0.0)[:, None]
            wu = wu * tl.load(up_scales + k_col, mask=n_ok, other=0.0)[:, None]
        gate_acc += wg * xv
        up_acc += wu * xv
    gate = tl.sum(gate_acc, axis=1)
    up = tl.sum(up_acc, axis=1)
    if FP8 and not K_BLOCKED:  # one scale per row over the whole of K
        gate = gate * tl.load(gate_scales, mask=n_ok, other=0.0)
        up = up * tl.load(up_scales, mask=n_ok, other=0.0)
    if HAS_BIAS:
        b_row = bias_ptr + expert * stride_be
        gate += tl.load(b_row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b_row + inter + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if SWIGLUOAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    out = out_ptr + pair.to(tl.int64) * stride_om + offs_n
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_rows_kernel(a_ptr, w_ptr, bias_ptr, ids_ptr, weights_ptr, out_ptr, top_k, H, inter,
                      stride_am, stride_we, stride_wn, stride_be, stride_om, s_ptr, stride_se,
                      stride_sn, stride_sk, scale_n, scale_k, HAS_BIAS: tl.constexpr,
                      FP8: tl.constexpr, K_BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(top_k):
        pair = token * top_k + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        a_row = a_ptr + pair.to(tl.int64) * stride_am
        w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        if FP8:
            scales = s_ptr + expert * stride_se + (offs_n // scale_n) * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < inter
            av = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if K_BLOCKED:
                w = w * tl.load(scales + (k0 // scale_k) * stride_sk, mask=n_ok,
                                other=0.0)[:, None]
            acc += w * av
        row = tl.sum(acc, axis=1)
        if FP8 and not K_BLOCKED:
            row = row * tl.load(scales, mask=n_ok, other=0.0)
        if HAS_BIAS:
            row += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok,
                           other=0.0).to(tl.float32)
        total += row * tl.load(weights_ptr + pair).to(tl.float32)
    out = out_ptr + token.to(tl.int64) * stride_om + offs_n
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=n_ok)


def moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
               w2_bias: torch.Tensor | None = None, activation: str = "silu",
               alpha: float = 1.702, limit: float = 7.0,
               block_n: tuple[int, int] = (GATE_UP_BLOCK_N, DOWN_BLOCK_N),
               block_k: int = BLOCK_K, num_warps: int = NUM_WARPS, *,
               scales: tuple | None = None) -> torch.Tensor:
    """``vllmpy.ops.fused_moe.fused_moe``'s output for a few tokens (T * k up to
    ``DECODE_PAIRS``; the caller checks shapes and dtypes). ``block_n`` / ``block_k`` /
    ``num_warps`` override the launch shape. FP8 experts come with ``scales``: the two
    scale grids of ``fused_moe`` (grid [E, rows, cols], rows and columns per scale,
    the up rows' first grid row), each weight element's scale looked up per K tile (a
    tile never straddles two blocks) or, for one scale over all of K, applied to the row
    sums."""
    tokens, hidden = x.shape
    inter_size = w13.shape[1] // 2
    top_k = ids.shape[1]
    pairs = tokens * top_k
    has_bias = w13_bias is not None
    b13 = w13_bias if w13_bias is not None else w13
    b2 = w2_bias if w2_bias is not None else w2
    fp8 = scales is not None
    s13, s2 = scales if scales is not None else (None, None)
    k13 = _k_tile(block_k, s13)
    k2 = _k_tile(block_k, s2)
    flat_ids = ids.reshape(-1).contiguous()
    inter = torch.empty((pairs, inter_size), dtype=x.dtype, device=x.device)
    _gate_up_rows_kernel[(pairs, triton.cdiv(inter_size, block_n[0]))](
        x, w13, b13, flat_ids, inter, top_k, hidden, inter_size, x.stride(0), w13.stride(0),
        w13.stride(1), b13.stride(0), inter.stride(0), float(alpha), float(limit),
        *_grid_args(s13, w13), s13.up_row0 if s13 is not None else 0, HAS_BIAS=has_bias,
        SWIGLUOAI=activation == "swigluoai", FP8=fp8,
        K_BLOCKED=s13 is not None and s13.k_blocked, BLOCK_N=block_n[0], BLOCK_K=k13,
        num_warps=num_warps)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    _down_rows_kernel[(tokens, triton.cdiv(hidden, block_n[1]))](
        inter, w2, b2, flat_ids, weights.reshape(-1).to(torch.float32).contiguous(), out,
        top_k, hidden, inter_size, inter.stride(0), w2.stride(0), w2.stride(1), b2.stride(0),
        out.stride(0), *_grid_args(s2, w2), HAS_BIAS=has_bias, FP8=fp8,
        K_BLOCKED=s2 is not None and s2.k_blocked, BLOCK_N=block_n[1], BLOCK_K=k2,
        num_warps=num_warps)
    return out


def _k_tile(block_k: int, grid) -> int:
    """The K tile, narrowed to divide the scale block along K when scales change along K."""
    if grid is None or not grid.k_blocked:
        return block_k
    return math.gcd(block_k, grid.k)


def _grid_args(grid, fallback: torch.Tensor) -> tuple:
    if grid is None:  # unused by the float kernels
        return (fallback, 0, 0, 0, 1, 1)
    g = grid.grid
    return (g, g.stride(0), g.stride(1), g.stride(2), grid.n, grid.k)
