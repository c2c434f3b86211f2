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
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

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
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs,
                    top_k, H, inter, num_experts, stride_xm, stride_we, stride_wn, stride_om,
                    stride_be, alpha, limit, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SWIGLUOAI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
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
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < H
            a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(up_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                a = a.to(tl.float32)
                gate = tl.dot(a, wg.to(tl.float32), gate, input_precision="ieee")
                up = tl.dot(a, wu.to(tl.float32), up, input_precision="ieee")
            else:
                gate = tl.dot(a, wg, gate)
                up = tl.dot(a, wu, up)
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
                 stride_be, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < inter
            a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
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


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = "silu",
              alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The experts' output [T, H] in x's dtype (``vllmpy.layers.moe.moe_reference``'s
    sum): x [T, H] float32 / bfloat16 / float16, w13 [E, 2I, H] and w2 [E, H, I] in x's
    dtype, optional biases [E, 2I] / [E, H], weights / ids [T, k]; ``activation`` silu or
    swigluoai (``vllmpy.layers.moe.expert_activation``). Each product accumulates in
    fp32; the intermediate act(gate, up) is rounded to x's dtype, as the reference
    rounds it."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = ids.shape[1]
    if tuple(w13.shape[1:]) != (two_i, hidden) or tuple(w2.shape) != (num_experts, hidden,
                                                                       inter_size):
        raise ValueError(f"fused_moe needs w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe takes expert weights in x's dtype {x.dtype}, got "
                         f"{w13.dtype} and {w2.dtype}")
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"unknown expert activation {activation!r} (silu or swigluoai)")
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("fused_moe takes both expert biases or neither")
    has_bias = w13_bias is not None
    if has_bias and (tuple(w13_bias.shape) != (num_experts, two_i)  # type: ignore[union-attr]
                     or tuple(w2_bias.shape) != (num_experts, hidden)):  # type: ignore[union-attr]
        raise ValueError(f"fused_moe needs biases [E, {two_i}] and [E, {hidden}], got "
                         f"{tuple(w13_bias.shape)} and {tuple(w2_bias.shape)}")  # type: ignore[union-attr]
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    b13 = w13_bias.contiguous() if has_bias else w13  # type: ignore[union-attr]
    b2 = w2_bias.contiguous() if has_bias else w2  # type: ignore[union-attr]
    pairs = tokens * top_k
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
        b13.stride(0), float(alpha), float(limit), IEEE=ieee, HAS_BIAS=has_bias,
        SWIGLUOAI=activation == "swigluoai", BLOCK_M=BLOCK_M, BLOCK_N=n_gate,
        BLOCK_K=block_k, num_warps=4)
    per_pair = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, n_down))](
        inter, w2, b2, per_pair, sorted_pairs, block_expert,
        weights.reshape(-1).to(torch.float32).contiguous(), pairs, hidden, inter_size,
        num_experts, inter.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        b2.stride(0), IEEE=ieee, HAS_BIAS=has_bias, BLOCK_M=BLOCK_M, BLOCK_N=n_down,
        BLOCK_K=block_k, num_warps=4)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
