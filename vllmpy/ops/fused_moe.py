"""The experts of a MoE layer as two grouped GEMMs over tokens sorted by expert.

Given x [T, H], the router's choice ``ids`` / ``weights`` [T, k] and the stacked expert
weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I]:

1. ``align_by_expert`` sorts the T * k (token, slot) pairs by expert and pads each
   expert's run to a multiple of BLOCK_M: ``sorted_pairs`` holds pair indices (T * k
   marks padding) and ``block_expert`` the expert of each BLOCK_M block (E past the
   last one). A decode step's few pairs take one Triton program; more take PyTorch's
   stable sort. Every size is fixed by T, k, E and BLOCK_M and nothing is read back to the
   host, so a decode step with it can be captured in a CUDA graph.
2. ``_gate_up_kernel``: for each block and tile of I columns it gathers the block's token
   rows of x, multiplies them by its expert's gate and up tiles (two fp32 accumulators)
   and stores silu(gate) * up for each pair: inter [T * k, I].
3. ``_down_kernel``: the same over inter and w2, each row times its routing weight,
   stored per pair: [T * k, H]; the k rows of a token are then summed.

A block reads only its own expert's weights, so a batch-1 decode step reads the k chosen
experts and no other. float32 inputs take IEEE fp32 dots (not TF32); 16-bit ones multiply
in their dtype with fp32 accumulation; the interpreter's dot misreads bfloat16 tiles, so
there they go through fp32 (the same products).

FP8 experts (``FP8`` constexpr; the float kernels compile as before): w13 / w2 hold
float8_e4m3fn codes and a grid of fp32 scales per expert, one scale per
[scale_n x scale_k] block of a weight. w13's grid stacks the gate blocks, then the up
blocks (a gate row r takes scale row r // scale_n, an up row r row up_row0 + r // scale_n);
per-tensor scales are the grid of one block per projection. The activations stay in x's
dtype: a tile of codes is widened exactly to it (e4m3 fits in bf16 / fp16), multiplied,
and the fp32 partial product scaled per column, at each K step when the scales change
along K (``K_BLOCKED``: the K tile then divides scale_k) or once after the loop.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllmpy.ops.moe_decode import DECODE_PAIRS, moe_decode

BLOCK_M = 16


# up to this many (token, slot) pairs are aligned by one Triton program (a decode step);
# more by PyTorch's sort
ALIGN_ONE_PROGRAM = 64


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, capacity,
                  num_experts, PAIRS: tl.constexpr, EXPERTS: tl.constexpr,
                  SLOTS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    # align_by_expert in one program: counts, padded run starts, each pair's rank among
    # the earlier pairs of its expert (a [PAIRS, PAIRS] comparison), the scatter, and
    # each block's expert
    offs = tl.arange(0, PAIRS)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=num_experts).to(tl.int32)
    offs_e = tl.arange(0, EXPERTS)
    counts = tl.sum((expert[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    earlier = (expert[None, :] == expert[:, None]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.sum(tl.where(offs_e[None, :] == expert[:, None], padded_start[None, :], 0),
                   axis=1)
    slots = tl.arange(0, SLOTS)
    tl.store(sorted_ptr + slots, tl.zeros((SLOTS,), dtype=tl.int32) + num_pairs,
             mask=slots < capacity)
    tl.debug_barrier()
    tl.store(sorted_ptr + start + rank, offs, mask=ok)
    blocks = tl.arange(0, BLOCKS)
    owner = tl.sum((padded_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32)
                   * (offs_e[None, :] < num_experts).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks * BLOCK_M < capacity)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M,
                    one_program: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [T * k + E * (block_m - 1)], block_expert [that / block_m]) of expert
    ids [T, k]; see the module docstring. ``one_program`` picks the one-program Triton
    kernel (default: for up to ALIGN_ONE_PROGRAM pairs) over PyTorch's sort; both give
    the same arrays."""
    flat = ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    if one_program is None:
        one_program = 0 < pairs <= ALIGN_ONE_PROGRAM and num_experts <= 1024
    if one_program:
        capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
        sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=ids.device)
        _align_kernel[(1,)](
            flat, sorted_pairs, block_expert, pairs, capacity, num_experts,
            PAIRS=max(16, triton.next_power_of_2(pairs)),
            EXPERTS=max(16, triton.next_power_of_2(num_experts)),
            SLOTS=triton.next_power_of_2(capacity),
            BLOCKS=max(16, triton.next_power_of_2(capacity // block_m)), BLOCK_M=block_m,
            num_warps=8)
        return sorted_pairs, block_expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(pairs, device=ids.device) - run_start[expert_sorted]
    dest = padded_end[expert_sorted] - padded[expert_sorted] + rank
    capacity = pairs + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert  # a block past the last run gets expert E


@triton.jit
def _fp8_step(a, w, acc, s_ptrs, s_ok, k_offset, IEEE: tl.constexpr, K_BLOCKED: tl.constexpr):
    # one K step with a tile of fp8 codes: widened exactly to a's dtype (fp32 for IEEE
    # dots), and with K_BLOCKED this K block's per-column scales applied to the product
    if IEEE:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    else:
        w = w.to(a.dtype)
    if K_BLOCKED:
        scale = tl.load(s_ptrs + k_offset, mask=s_ok, other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        else:
            acc += tl.dot(a, w) * scale[None, :]
    elif IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                    top_k, H, inter, num_experts, stride_xm, stride_we, stride_wn, stride_om,
                    stride_be, alpha, limit, s_ptr, stride_se, stride_sn, stride_sk, scale_n,
                    scale_k, up_row0, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SWIGLUOAI: tl.constexpr, FP8: tl.constexpr, K_BLOCKED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        token = pair // top_k
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + token[:, None].to(tl.int64) * stride_xm
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        gate_rows = w_base + offs_n[None, :].to(tl.int64) * stride_wn
        up_rows = w_base + (offs_n + inter)[None, :].to(tl.int64) * stride_wn
        if FP8:  # each column's scale row: gate blocks, then up blocks
            s_base = s_ptr + expert.to(tl.int64) * stride_se
            gate_scales = s_base + (offs_n // scale_n) * stride_sn
            up_scales = s_base + (up_row0 + offs_n // scale_n) * stride_sn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < H
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                k_scale = (k0 // scale_k) * stride_sk
                gate = _fp8_step(a, wg, gate, gate_scales, n_ok, k_scale, IEEE, K_BLOCKED)
                up = _fp8_step(a, wu, up, up_scales, n_ok, k_scale, IEEE, K_BLOCKED)
            elif IEEE:
                a = a.to(tl.float32)
                gate = tl.dot(a, wg.to(tl.float32), gate, input_precision="ieee")
                up = tl.dot(a, wu.to(tl.float32), up, input_precision="ieee")
            else:
                gate = tl.dot(a, wg, gate)
                up = tl.dot(a, wu, up)
        if FP8 and not K_BLOCKED:  # one scale per column over the whole of K
            gate *= tl.load(gate_scales, mask=n_ok, other=0.0)[None, :]
            up *= tl.load(up_scales, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            b_rows = bias_ptr + expert.to(tl.int64) * stride_be
            gate += tl.load(b_rows + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b_rows + inter + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLUOAI:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            act = gate / (1.0 + tl.exp(-gate)) * up
        out = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
                 num_pairs, H, inter, num_experts, stride_am, stride_we, stride_wn, stride_om,
                 stride_be, s_ptr, stride_se, stride_sn, stride_sk, scale_n, scale_k,
                 IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                 K_BLOCKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < num_experts:
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + pair[:, None].to(tl.int64) * stride_am
        w_rows = (w_ptr + expert.to(tl.int64) * stride_we
                  + offs_n[None, :].to(tl.int64) * stride_wn)
        if FP8:
            scales = (s_ptr + expert.to(tl.int64) * stride_se
                      + (offs_n // scale_n) * stride_sn)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < inter
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                acc = _fp8_step(a, w, acc, scales, n_ok, (k0 // scale_k) * stride_sk, IEEE,
                                K_BLOCKED)
            elif IEEE:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if FP8 and not K_BLOCKED:
            acc *= tl.load(scales, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            b = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_ok,
                        other=0.0)
            acc += b.to(tl.float32)[None, :]
        scale = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        out = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & n_ok[None, :])


def _ieee(x: torch.Tensor) -> bool:
    interpreted = x.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"
    return x.dtype == torch.float32 or interpreted


FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class _Scales:
    """One GEMM's fp8 scale grid [E, rows, cols] and how a weight element finds its scale:
    row r -> r // n (up rows: up_row0 + r // n), column c -> c // k."""

    grid: torch.Tensor
    n: int
    k: int
    up_row0: int = 0

    @property
    def k_blocked(self) -> bool:
        return self.grid.shape[2] > 1


def _fp8_scales(w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                scale_block: tuple[int, int] | None, num_experts: int, hidden: int,
                inter: int) -> tuple[_Scales, _Scales]:
    e = num_experts
    if scale_block is None:  # per tensor: [E, 2] (gate, up) and [E]
        if w13_scale.numel() != 2 * e or w2_scale.numel() != e:
            raise ValueError(f"fused_moe with per-tensor fp8 scales needs w13_scale [E, 2] "
                             f"and w2_scale [E] for E={e}, got {tuple(w13_scale.shape)} and "
                             f"{tuple(w2_scale.shape)}")
        return (_Scales(w13_scale.reshape(e, 2, 1), inter, hidden, 1),
                _Scales(w2_scale.reshape(e, 1, 1), hidden, inter))
    bn, bk = scale_block
    gate_rows = triton.cdiv(inter, bn)
    want13 = (e, 2 * gate_rows, triton.cdiv(hidden, bk))
    want2 = (e, triton.cdiv(hidden, bn), triton.cdiv(inter, bk))
    if tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"fused_moe with {bn}x{bk} fp8 scale blocks needs w13_scale {want13} "
                         f"and w2_scale {want2}, got {tuple(w13_scale.shape)} and "
                         f"{tuple(w2_scale.shape)}")
    return _Scales(w13_scale, bn, bk, gate_rows), _Scales(w2_scale, bn, bk)


def _k_tile(block_k: int, scales: _Scales | None) -> int:
    """The K tile: the preferred one, narrowed to divide the scale block along K when the
    scales change along K (a tile never straddles two scale blocks)."""
    if scales is None or not scales.k_blocked:
        return block_k
    tile = math.gcd(block_k, scales.k)
    if tile < 16:
        raise ValueError(f"fused_moe: fp8 scale blocks {scales.k} wide along K need a "
                         "multiple of 16")
    return tile


def _scale_args(scales: _Scales | None, fallback: torch.Tensor) -> tuple:
    if scales is None:  # unused by the float kernels
        return (fallback, 0, 0, 0, 1, 1)
    g = scales.grid
    return (g, g.stride(0), g.stride(1), g.stride(2), scales.n, scales.k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = "silu",
              alpha: float = 1.702, limit: float = 7.0, *,
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              scale_block: tuple[int, int] | None = None,
              rows: bool | None = None) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype (``vllmpy.layers.moe.moe_reference``'s
    sum): x [T, H] float32 / bfloat16 / float16, w13 [E, 2I, H] and w2 [E, H, I] in x's
    dtype, optional biases [E, 2I] / [E, H], weights / ids [T, k]; ``activation`` silu or
    swigluoai (``vllmpy.layers.moe.expert_activation``). Each product accumulates in
    fp32; the intermediate act(gate, up) is rounded to x's dtype, as the reference
    rounds it.

    FP8 experts: w13 / w2 float8_e4m3fn with fp32 ``w13_scale`` / ``w2_scale`` — per
    tensor ([E, 2]: gate, up; [E]) without ``scale_block``, or with ``scale_block``
    (bn, bk) one scale per bn x bk block: w13_scale [E, 2 * ceil(I / bn), ceil(H / bk)]
    (the gate's blocks, then the up's), w2_scale [E, ceil(H / bn), ceil(I / bk)]; the
    weight is code * scale, the activations stay in x's dtype."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = ids.shape[1]
    if tuple(w13.shape[1:]) != (two_i, hidden) or tuple(w2.shape) != (num_experts, hidden,
                                                                       inter_size):
        raise ValueError(f"fused_moe needs w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    fp8 = w13.dtype == FP8 and w2.dtype == FP8
    if not fp8 and (w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise ValueError(f"fused_moe takes expert weights in x's dtype {x.dtype} (or both in "
                         f"float8_e4m3fn with scales), got {w13.dtype} and {w2.dtype}")
    if fp8 != (w13_scale is not None and w2_scale is not None) or (
            not fp8 and (w13_scale is not None or w2_scale is not None)):
        raise ValueError("fused_moe takes w13_scale and w2_scale with float8_e4m3fn expert "
                         "weights, and no scales otherwise")
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"unknown expert activation {activation!r} (silu or swigluoai)")
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("fused_moe takes both expert biases or neither")
    has_bias = w13_bias is not None
    if has_bias and (tuple(w13_bias.shape) != (num_experts, two_i)  # type: ignore[union-attr]
                     or tuple(w2_bias.shape) != (num_experts, hidden)):  # type: ignore[union-attr]
        raise ValueError(f"fused_moe needs biases [E, {two_i}] and [E, {hidden}], got "
                         f"{tuple(w13_bias.shape)} and {tuple(w2_bias.shape)}")  # type: ignore[union-attr]
    s13 = s2 = None
    if fp8:
        s13, s2 = _fp8_scales(w13_scale.float().contiguous(),  # type: ignore[union-attr]
                              w2_scale.float().contiguous(),  # type: ignore[union-attr]
                              scale_block, num_experts, hidden, inter_size)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    b13 = w13_bias.contiguous() if has_bias else w13  # type: ignore[union-attr]
    b2 = w2_bias.contiguous() if has_bias else w2  # type: ignore[union-attr]
    pairs = tokens * top_k
    if rows is None:
        rows = not _ieee(x) and pairs <= DECODE_PAIRS
    if rows:
        return moe_decode(x, w13, w2, weights, ids, b13 if has_bias else None,
                          b2 if has_bias else None, activation, alpha, limit,
                          scales=(s13, s2) if fp8 else None)
    sorted_pairs, block_expert = align_by_expert(ids, num_experts)
    ieee = _ieee(x)
    blocks = block_expert.numel()
    inter = torch.empty((pairs, inter_size), dtype=x.dtype, device=x.device)
    # few pairs (decode): narrow column tiles, so the chosen experts' weights are
    # streamed by many programs at once
    few = pairs <= ALIGN_ONE_PROGRAM
    block_k = 32 if ieee else (128 if few else 64)
    n_gate, n_down = (16, 32) if few else (64, 64)
    _gate_up_kernel[(blocks, triton.cdiv(inter_size, n_gate))](
        x, w13, b13, inter, sorted_pairs, block_expert, pairs, top_k, hidden, inter_size,
        num_experts, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        b13.stride(0), float(alpha), float(limit), *_scale_args(s13, w13),
        s13.up_row0 if s13 is not None else 0, IEEE=ieee, HAS_BIAS=has_bias,
        SWIGLUOAI=activation == "swigluoai", FP8=fp8,
        K_BLOCKED=s13 is not None and s13.k_blocked, BLOCK_M=BLOCK_M, BLOCK_N=n_gate,
        BLOCK_K=_k_tile(block_k, s13), num_warps=4)
    per_pair = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, n_down))](
        inter, w2, b2, per_pair, sorted_pairs, block_expert,
        weights.reshape(-1).to(torch.float32).contiguous(), pairs, hidden, inter_size,
        num_experts, inter.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        b2.stride(0), *_scale_args(s2, w2), IEEE=ieee, HAS_BIAS=has_bias, FP8=fp8,
        K_BLOCKED=s2 is not None and s2.k_blocked, BLOCK_M=BLOCK_M, BLOCK_N=n_down,
        BLOCK_K=_k_tile(block_k, s2), num_warps=4)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
