"""Softmax routing of a Mixture-of-Experts layer in one launch: for each token's router
logits, the softmax over every expert in fp32, its ``top_k`` largest probabilities and
their experts (largest first; among equal probabilities the lower expert id first), the
weights renormalized to sum to 1 when asked, times a scaling factor.

``select_experts`` (``vllmpy.layers.moe``) takes it on CUDA for the softmax scoring
without expert groups, where PyTorch takes four launches (softmax, topk, sum, divide):
at batch 1 each costs more than its arithmetic (docs/perf-log/moe.md). The PyTorch
reference is ``select_experts``'s own path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllmpy.ops.checks import check_float
from vllmpy.ops.pdl import pdl_args, pdl_wait

# experts a launch takes (a row is held in one program's registers)
MAX_EXPERTS = 1024


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, scale,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                         RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    pdl_wait(PDL)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_l + offs, mask=ok,
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    p = e / tl.sum(e, axis=0)  # padding: exp(-inf) = 0
    p = tl.where(ok, p, -1.0)  # never chosen
    ks = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id of a tie
        w = tl.where(ks == j, best, w)
        ids = tl.where(ks == j, pick, ids)
        p = tl.where(offs == pick, -1.0, p)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=0)  # the padding adds zeros
    w = w * scale
    kept = ks < TOP_K
    tl.store(weights_ptr + row * TOP_K + ks, w, mask=kept)
    tl.store(ids_ptr + row * TOP_K + ks, ids.to(tl.int64), mask=kept)


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], ids int64 [T, top_k]) of router logits [T, E] (E up to
    MAX_EXPERTS, contiguous rows); see the module docstring."""
    check_float("logits", logits, "MoE routing kernel")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"router logits must be [T, E] with contiguous rows, got "
                         f"{tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"the routing kernel takes 1 <= top_k ({top_k}) <= E ({e}) <= "
                         f"{MAX_EXPERTS}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), float(scale), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_E=max(16, triton.next_power_of_2(e)), RENORMALIZE=renormalize,
            num_warps=1 if e <= 256 else 4, **pdl_args(logits.device))
    return weights, ids
