"""GPU time of the decode GEMMs of the benchmark configs, each timed as 50 calls replayed
from a CUDA graph.

    python benchmarks/investigations/skinny_gemm_sweep.py            # cuBLAS against the skinny kernel's
                                                      # launch configurations, M = 1, 4, 8
    python benchmarks/investigations/skinny_gemm_sweep.py --fused    # one-row layer steps: the norm or
                                                      # SiLU launch plus the GEMM, against
                                                      # the fused kernel
    python benchmarks/investigations/skinny_gemm_sweep.py --fused --every   # each step under each of
                                                      # EVERY_CONFIGS
    python benchmarks/investigations/skinny_gemm_sweep.py --hot 8b   # each one-row step, weights cold
                                                      # and hot in L2, beside cuBLAS
"""

from __future__ import annotations

import argparse
import itertools

import torch

from vllmpy.ops.fused import rms_norm, silu_and_mul
from vllmpy.ops.skinny_gemm import PLAIN, RMS_NORM, SILU_MUL, _launch, skinny_gemm

SHAPES = {  # name -> (N, K)
    "0.6b qkv": (4096, 1024), "0.6b o": (1024, 2048), "0.6b gate_up": (6144, 1024),
    "0.6b down": (1024, 3072), "8b qkv": (6144, 4096), "8b o": (4096, 4096),
    "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
}
COPY_RATE = 4.27e12  # the H200's measured HBM copy rate, bytes/s


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


def fastest(configs, call, matches=None, label: str = "") -> tuple[float, tuple | None]:
    """(us, config) of the fastest ``call(config)``; a configuration the compiler rejects,
    or whose output ``matches()`` refuses, is reported and skipped."""
    best, best_cfg = float("inf"), None
    for cfg in configs:
        try:
            if matches is not None:
                call(cfg)
                torch.cuda.synchronize()
                if not matches():
                    print(f"  mismatch {label} {cfg}")
                    continue
            t = gpu_us(lambda cfg=cfg: call(cfg))
        except Exception as exc:  # a configuration the compiler rejects
            print(f"  failed {cfg}: {type(exc).__name__}")
            continue
        if t < best:
            best, best_cfg = t, cfg
    return best, best_cfg


def sweep() -> None:
    dev = torch.device("cuda")
    configs = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (3, 5)))
    print(f"{'shape':14} {'M':>2} {'roof_us':>7} {'cublas':>7} {'best':>7} config")
    for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 4, 8)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        cublas = gpu_us(lambda x=x, w=w: torch.nn.functional.linear(x, w))

        def call(cfg, x=x, w=w, out=out):
            _launch(x, None, None, None, w, None, out, PLAIN, 0.0, *cfg)

        def matches(out=out, ref=ref):
            return torch.allclose(out.float(), ref.float(), atol=0.1, rtol=0.02)
        best, best_cfg = fastest(configs, call, matches, f"{name} M={m}")
        roof = n * k * 2 / COPY_RATE * 1e6
        print(f"{name:14} {m:>2} {roof:7.2f} {cublas:7.2f} {best:7.2f} {best_cfg}")


FUSED_CONFIGS = [(8, 512, 4, 3), (4, 512, 4, 3), (2, 512, 4, 3), (16, 512, 4, 3),
                 (8, 1024, 8, 3), (4, 1024, 8, 3), (2, 1024, 4, 3), (4, 256, 4, 4)]
# --every: each of these on each one-row step (rows, chunk, warps, stages)
EVERY_CONFIGS = [(1, 1024, 4, 3), (2, 1024, 4, 3), (2, 1024, 8, 3), (4, 1024, 4, 3),
                 (4, 1024, 8, 3), (8, 1024, 4, 3), (8, 1024, 8, 3), (8, 2048, 8, 3),
                 (4, 512, 4, 3), (8, 512, 4, 3), (16, 512, 4, 3)]
L2_CLEAR_BYTES = 256 << 20  # weight copies cycled so that no call finds its weights in L2


def fused(every: bool = False) -> None:
    """One row, weights cold in L2 (each call reads another copy, as a decode step's
    layers do): the plain GEMM, (norm launch + GEMM) against rms_norm_gemm and (SiLU launch
    + GEMM) against silu_mul_gemm, over launch configurations; then the read rate of a
    large sum."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    print(f"{'step':16} {'roof_us':>7} {'plain':>7} {'2 launches':>10} {'fused':>7} best config")
    for name in ("qkv", "o", "gate_up", "down"):
        for model in ("0.6b", "8b"):
            n, k = SHAPES[f"{model} {name}"]
            copies = max(1, L2_CLEAR_BYTES // (n * k * 2))
            ws = [torch.randn(n, k, device=dev, dtype=bf16) for _ in range(copies)]
            turn = iter(range(1 << 30))

            def weight(ws=ws, turn=turn):
                return ws[next(turn) % len(ws)]
            out = torch.empty(1, n, device=dev, dtype=bf16)
            if name == "down":
                x = torch.randn(1, 2 * k, device=dev, dtype=bf16)
                plain_x = silu_and_mul(x)
                two = lambda x=x: skinny_gemm(silu_and_mul(x), weight())  # noqa: E731
                args, prologue = (x, None, None, None), SILU_MUL
            elif name == "o":
                plain_x = torch.randn(1, k, device=dev, dtype=bf16)
                two = lambda x=plain_x: skinny_gemm(x, weight())  # noqa: E731
                args, prologue = (plain_x, None, None, None), PLAIN
            else:
                x = torch.randn(1, k, device=dev, dtype=bf16)
                res = torch.randn(1, k, device=dev, dtype=bf16)
                nw = torch.rand(k, device=dev, dtype=bf16) + 0.5
                total = torch.empty_like(x)
                plain_x = x
                two = (lambda x=x, res=res, nw=nw:  # noqa: E731
                       skinny_gemm(rms_norm(x, nw, 1e-6, res)[0], weight()))
                args, prologue = (x, res, nw, total), RMS_NORM
            def call(cfg, args=args, out=out, prologue=prologue):
                _launch(*args, weight(), None, out, prologue, 1e-6, *cfg)
            if every:  # one line per step: the time of each launch configuration
                times = []
                for cfg in EVERY_CONFIGS:
                    times.append(f"{gpu_us(lambda cfg=cfg: call(cfg)):6.2f}")
                print(f"{model + ' ' + name:16} {n * k * 2 / COPY_RATE * 1e6:7.2f} "
                      + " ".join(times), flush=True)
                continue
            plain = gpu_us(lambda x=plain_x: skinny_gemm(x, weight()))
            unfused = gpu_us(two)
            best, best_cfg = fastest(FUSED_CONFIGS, call)
            roof = n * k * 2 / COPY_RATE * 1e6
            print(f"{model + ' ' + name:16} {roof:7.2f} {plain:7.2f} {unfused:10.2f} "
                  f"{best:7.2f} {best_cfg}", flush=True)
    big = torch.empty(1 << 30, device=dev, dtype=bf16).normal_()  # 2 GiB
    t = gpu_us(lambda: big.sum(), reps=5)
    print(f"read rate of a 2 GiB sum: {big.numel() * 2 / t / 1e3:.0f} GB/s")


def hot_cold(model: str) -> None:
    """One row: each decoder step of ``model`` under its default launch with its weight
    cold in L2 (each call reads another copy) and hot (every call reads one copy), beside
    cuBLAS cold. A step whose weight fits in L2 and whose launch runs no faster hot is
    bound by its own latency rather than by HBM."""
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    steps = {"qkv": RMS_NORM, "o": PLAIN, "gate_up": RMS_NORM, "down": SILU_MUL}
    print(f"{'step':16} {'MB':>6} {'roof_us':>7} {'cold':>7} {'hot':>7} {'cublas cold':>11}",
          flush=True)
    for name, prologue in steps.items():
        n, k = SHAPES[f"{model} {name}"]
        copies = max(1, L2_CLEAR_BYTES // (n * k * 2))
        ws = [torch.randn(n, k, device=dev, dtype=bf16) for _ in range(copies)]
        turn = iter(range(1 << 30))
        x = torch.randn(1, 2 * k if prologue == SILU_MUL else k, device=dev, dtype=bf16)
        plain_x = torch.randn(1, k, device=dev, dtype=bf16)
        res = torch.randn(1, k, device=dev, dtype=bf16) if prologue == RMS_NORM else None
        nw = torch.rand(k, device=dev, dtype=bf16) + 0.5 if prologue == RMS_NORM else None
        total = torch.empty(1, k, device=dev, dtype=bf16) if prologue == RMS_NORM else None
        out = torch.empty(1, n, device=dev, dtype=bf16)

        def once(w, x=x, res=res, nw=nw, total=total, out=out, prologue=prologue):
            _launch(x, res, nw, total, w, None, out, prologue, 1e-6)
        cold = gpu_us(lambda ws=ws, turn=turn, once=once: once(ws[next(turn) % len(ws)]))
        hot = gpu_us(lambda ws=ws, once=once: once(ws[0]))
        cublas = gpu_us(lambda ws=ws, turn=turn, x=plain_x: torch.nn.functional.linear(
            x, ws[next(turn) % len(ws)]))
        print(f"{model + ' ' + name:16} {n * k * 2 / 1e6:6.1f} "
              f"{n * k * 2 / COPY_RATE * 1e6:7.2f} {cold:7.2f} {hot:7.2f} {cublas:11.2f}",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fused", action="store_true",
                    help="time the one-row fused steps instead of the launch sweep")
    ap.add_argument("--every", action="store_true",
                    help="with --fused: every configuration of EVERY_CONFIGS on every step")
    ap.add_argument("--hot", metavar="MODEL", choices=("0.6b", "8b"),
                    help="MODEL's one-row steps with their weights cold and hot in L2")
    args = ap.parse_args()
    if args.hot:
        hot_cold(args.hot)
        return
    if args.every:
        print("configs (rows, chunk, warps, stages):", EVERY_CONFIGS)
    fused(args.every) if args.fused else sweep()


if __name__ == "__main__":
    main()
