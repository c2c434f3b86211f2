"""Compile time of each Triton kernel variant a batch-1 Qwen3-8B decode uses, from an
empty kernel cache: the first call (compile + launch) against the second (launch only).

    rm -rf ~/.triton/cache && python benchmarks/investigations/compile_times.py
"""

from __future__ import annotations

import time

import torch


def first_and_second(fn) -> tuple[float, float]:
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def main() -> None:
    from vllmpy.ops.fused import qk_norm_rotary, rms_norm
    from vllmpy.ops.paged_attention import paged_attention
    from vllmpy.ops.skinny_gemm import rms_norm_gemm, silu_mul_gemm, skinny_gemm

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter, heads, kv_heads, dim = 4096, 12288, 32, 8, 128
    x = torch.randn(1, hidden, device=dev, dtype=bf16)
    res = torch.randn(1, hidden, device=dev, dtype=bf16)
    nw = torch.ones(hidden, device=dev, dtype=bf16)
    w_qkv = torch.randn((heads + 2 * kv_heads) * dim, hidden, device=dev, dtype=bf16)
    w_o = torch.randn(hidden, heads * dim, device=dev, dtype=bf16)
    w_down = torch.randn(hidden, inter, device=dev, dtype=bf16)
    gate_up = torch.randn(1, 2 * inter, device=dev, dtype=bf16)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, device=dev, dtype=bf16)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    positions = torch.zeros(1, dtype=torch.int64, device=dev)
    cos_sin = torch.randn(64, dim, device=dev)
    cache = torch.zeros(2, 4, 32, kv_heads, dim, device=dev, dtype=bf16)
    slots = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.empty(1, heads, dim, device=dev, dtype=bf16)
    cases = {
        "skinny plain (o_proj)": lambda: skinny_gemm(x, w_o),
        "skinny norm, no residual": lambda: rms_norm_gemm(x, None, nw, 1e-6, w_qkv),
        "skinny norm + residual": lambda: rms_norm_gemm(x, res, nw, 1e-6, w_qkv),
        "skinny SiLU (down)": lambda: silu_mul_gemm(gate_up, w_down),
        "q/k norm + rotary + store": lambda: qk_norm_rotary(
            positions, q, k, nw[:dim], nw[:dim], 1e-6, cos_sin, dim, v, cache, slots),
        "rms_norm + residual": lambda: rms_norm(x, nw, 1e-6, res),
        "decode attention (split)": lambda: paged_attention(
            q.view(1, heads, dim), cache, out,
            torch.tensor([0, 1], dtype=torch.int32, device=dev),
            torch.tensor([1], dtype=torch.int32, device=dev),
            torch.zeros(1, 4, dtype=torch.int32, device=dev), scale=dim ** -0.5,
            max_query_len=1, max_seq_len=40960),
    }
    print(f"{'kernel':28} {'first s':>8} {'second ms':>10}")
    total = 0.0
    for name, fn in cases.items():
        first, second = first_and_second(fn)
        total += first - second
        print(f"{name:28} {first:8.2f} {second * 1e3:10.2f}", flush=True)
    print(f"compile total {total:.2f} s")


if __name__ == "__main__":
    main()
