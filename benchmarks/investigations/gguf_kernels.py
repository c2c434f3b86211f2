"""GPU time of the GGUF matmul kernels (vllmpy.ops.gguf_gemm) on Qwen3-8B's matrices.

    python benchmarks/investigations/gguf_kernels.py                 # the table: Q4_K, Q6_K, Q8_0, Q4_0
                                                      # at M = 1 and M = 256
    python benchmarks/investigations/gguf_kernels.py --types Q4_K --m 1,4
    python benchmarks/investigations/gguf_kernels.py --cutover       # decode rows through the GEMV and
                                                      # the GEMM kernel, to set GEMV_MAX_M

Each row: the kernel's time per call (after warm-up, replayed from a CUDA graph), the
rate at which it reads the matrix's quantized bytes (GB/s and the share of the H200's
4.8 TB/s), TFLOP/s, a dense bf16 matmul of the same shape beside it, and the largest
difference from the PyTorch reference (``gguf_linear_ref``), as it is and relative to the
largest output. Each timed call reads a different copy of the matrix, so that the weights
come from HBM and not from L2. The matrices are random bytes with small fp16 scales; no
files are read.
"""

from __future__ import annotations

import argparse
import math

import torch

from vllmpy.ops.gguf_gemm import GEMV_MAX_M, _gemm, _gemv, gguf_linear, gguf_linear_ref
from vllmpy.ops.gguf_quants import _PLANES, BLOCK_SIZES, GGUFWeight, prepare

SHAPES = {  # name -> (N, K), Qwen3-8B
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
}
HBM_PEAK = 4.8e12  # the H200's nominal HBM bandwidth, bytes/s
COLD_BYTES = 256 << 20  # the weight copies a timing cycles through: several times L2
MAX_COPIES = 32


def random_weight(quant_type: str, n: int, k: int, gen: torch.Generator) -> GGUFWeight:
    """Random blocks on the GPU whose fp16 fields are small positive scales."""
    per_block, block_bytes = BLOCK_SIZES[quant_type]
    blocks = torch.randint(0, 256, (n, k // per_block, block_bytes), dtype=torch.uint8,
                           device="cuda", generator=gen)
    for start, end, dtype in _PLANES[quant_type].values():
        if dtype == torch.float16:
            scale = torch.rand((n, k // per_block, 1), device="cuda", generator=gen)
            scale = scale / 64 + 1 / 128
            blocks[:, :, start:end] = scale.half().view(torch.uint8)
    return prepare(blocks.view(n, -1), quant_type, n, k)


def weight_bytes(w: GGUFWeight) -> int:
    """The matrix's quantized bytes (its GGUF blocks), which a call reads once."""
    return sum(t.numel() * t.element_size() for t in w.planes().values())


def time_us(calls, reps: int = 20) -> float:
    """Mean time of one call, ``calls`` being closures captured in turn in a CUDA graph."""
    for fn in calls:  # warm-up: compiles, then settles
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def copies_of(quant_type: str, n: int, k: int, gen: torch.Generator) -> list[GGUFWeight]:
    first = random_weight(quant_type, n, k, gen)
    count = min(MAX_COPIES, max(1, math.ceil(COLD_BYTES / weight_bytes(first))))
    return [first] + [random_weight(quant_type, n, k, gen) for _ in range(count - 1)]


def measure(quant_type: str, name: str, weights: list[GGUFWeight], m: int,
            gen: torch.Generator) -> None:
    """One row of the table: ``m`` activation rows against the matrix (in its copies)."""
    n, k = weights[0].rows, weights[0].cols
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = gguf_linear_ref(x, weights[0])
    err = (gguf_linear(x, weights[0]).float() - ref.float()).abs().max().item()
    rel = err / ref.float().abs().max().item()
    us = time_us([lambda w=w: gguf_linear(x, w, out=out) for w in weights])
    dense = weights[0].dequantize(torch.bfloat16)
    dense_us = time_us([lambda: torch.mm(x, dense.t(), out=out)])
    gbs = weight_bytes(weights[0]) / us / 1e3
    print(f"{quant_type:6} {name:8} {n:6} {k:6} {m:4} {us:8.1f} {gbs:7.0f} "
          f"{100 * gbs * 1e9 / HBM_PEAK:5.1f} {2 * m * n * k / us / 1e6:8.2f} "
          f"{dense_us:8.1f} {err:8.1e} {rel:8.1e}", flush=True)


def table(types: list[str], ms: list[int]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'type':6} {'shape':8} {'N':>6} {'K':>6} {'M':>4} {'us':>8} {'GB/s':>7} "
          f"{'%HBM':>5} {'TFLOP/s':>8} {'bf16 us':>8} {'max err':>8} {'rel err':>8}")
    for quant_type in types:
        for name, (n, k) in SHAPES.items():
            try:
                weights = copies_of(quant_type, n, k, gen)
                for m in ms:
                    measure(quant_type, name, weights, m, gen)
            except RuntimeError as exc:  # out of memory, a kernel that fails to compile
                print(f"{quant_type:6} {name:8} failed: {exc}")
            weights = []
            torch.cuda.empty_cache()


def cutover(types: list[str]) -> None:
    """Decode rows through both kernels: GEMV_MAX_M should be the last M at which the
    GEMV is the faster."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    print(f"GEMV_MAX_M = {GEMV_MAX_M}")
    print(f"{'type':6} {'shape':8} {'M':>3} {'GEMV us':>8} {'GEMM us':>8}")
    for quant_type in types:
        for name in ("o", "gate_up"):
            n, k = SHAPES[name]
            weights = copies_of(quant_type, n, k, gen)
            for m in (1, 2, 4, 8):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                gemv = time_us([lambda w=w, x=x, out=out: _gemv(x, w, None, out)
                                for w in weights])
                gemm = time_us([lambda w=w, x=x, out=out: _gemm(x, w, None, out)
                                for w in weights])
                print(f"{quant_type:6} {name:8} {m:3} {gemv:8.1f} {gemm:8.1f}", flush=True)
            weights = []
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0")
    p.add_argument("--m", default="1,256", help="activation rows, comma-separated")
    p.add_argument("--cutover", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gguf_kernels.py times CUDA kernels; no CUDA device is visible")
        return 1
    types = args.types.split(",")
    unknown = [t for t in types if t not in BLOCK_SIZES]
    if unknown:
        print(f"unknown types {unknown}; supported: {', '.join(BLOCK_SIZES)}")
        return 1
    print(torch.cuda.get_device_name(), flush=True)
    if args.cutover:
        cutover(types)
    else:
        table(types, [int(m) for m in args.m.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
