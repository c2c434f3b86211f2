"""What one link of a chain of dependent kernels costs on the GPU: LINKS launches of a
small Triton kernel, each reading the vector the one before wrote, replayed from a CUDA
graph, with and without programmatic dependent launch (vllmpy.ops.pdl). This is the floor
under every launch of a batch-1 decode step.

    python benchmarks/investigations/pdl_chain.py [--links 168]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from decode_attention_sweep import time_graph  # a sibling script (benchmarks/investigations/)

from vllmpy.ops.pdl import pdl_wait


@triton.jit
def _link(x_ptr, y_ptr, N: tl.constexpr, PDL: tl.constexpr):
    # every program reads the whole vector the previous link wrote (as a GEMM's prologue
    # reads its activation row), reduces it, and program 0 writes the next one
    pdl_wait(PDL)
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    s = tl.sum(x * x, axis=0)
    if tl.program_id(0) == 0:
        tl.store(y_ptr + offs, (x * 0.5 + s * 1e-9).to(y_ptr.dtype.element_ty))


def time_chain(links: int, programs: int, pdl: bool, warps: int) -> float:
    bufs = [torch.randn(1024, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    extra = {"launch_pdl": True} if pdl else {}

    def run() -> None:
        for i in range(links):
            _link[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], N=1024, PDL=pdl,
                               num_warps=warps, **extra)

    return time_graph(run, replays=50) / links


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--links", type=int, default=168)
    args = p.parse_args()
    print(f"{'programs':>9}{'warps':>6}{'PDL':>5}{'us per link':>13}")
    for programs in (1, 132, 264):
        for warps in (4, 8):
            for pdl in (False, True):
                us = time_chain(args.links, programs, pdl, warps)
                print(f"{programs:>9}{warps:>6}{'on' if pdl else 'off':>5}{us:>13.2f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
