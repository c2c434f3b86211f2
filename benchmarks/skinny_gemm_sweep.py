"""GPU time of the decode GEMMs of the benchmark configs: cuBLAS (F.linear) against the
skinny weight-streaming kernel over a few launch configurations, each timed as 50 calls
replayed from a CUDA graph.

    python benchmarks/skinny_gemm_sweep.py
"""

from __future__ import annotations

import itertools

import torch

from vllmpy.ops.skinny_gemm import _launch

SHAPES = {  # name -> (N, K)
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072), "8b qkv": (6144, 4096), "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
}


def gpu_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> None:
    dev = torch.device("cuda")
    configs = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (3, 5)))
    print(f"{'shape':14} {'M':>2} {'roof_us':>7} {'cublas':>7} {'best':>7} config")
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 4, 8)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        cublas = gpu_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        best, best_cfg = float("inf"), None
        for bn, bk, nw, ns in configs:
            try:
                _launch(x, w, None, out, bn, bk, nw, ns)
                torch.cuda.synchronize()
                if not torch.allclose(out.float(), ref.float(), atol=0.1, rtol=0.02):
                    print(f"  mismatch {name} M={m} {bn, bk, nw, ns}")
                    continue
                t = gpu_us(lambda c=(x, w, None, out, bn, bk, nw, ns): _launch(*c))
            except Exception as exc:  # a configuration the compiler rejects
                print(f"  failed {bn, bk, nw, ns}: {type(exc).__name__}")
                continue
            if t < best:
                best, best_cfg = t, (bn, bk, nw, ns)
        roof = n * k * 2 / 4.27e12 * 1e6
        print(f"{name:14} {m:>2} {roof:7.2f} {cublas:7.2f} {best:7.2f} {best_cfg}")


if __name__ == "__main__":
    main()
