"""GPU time of the quantized linear kernels (vllmpy.ops.fp8_gemm, vllmpy.ops.int4_gemm) on
Qwen3-8B's projection shapes, against bf16 ``F.linear`` on the same shapes.

    python benchmarks/investigations/quant_kernels.py            # the table
    python benchmarks/investigations/quant_kernels.py --sweep    # also the one-row fp8 GEMV's launch
                                                  # configurations, best first
    python benchmarks/investigations/quant_kernels.py --sweep-int4 --only-sweeps  # the int4 GEMV's
    python benchmarks/investigations/quant_kernels.py --sweep-stream --only-sweeps  # bf16 / fp8
                                                  # weights through the streaming kernel

Each case is timed as 20 calls replayed from a CUDA graph. One-row calls cycle through
copies of the weight that together exceed L2, as a decode step's layers do. GB/s counts
the bytes of weight (and weight scales) read; TFLOP/s counts 2 * M * N * K. The error is
the largest difference from the PyTorch reference over at most 256 rows, relative to the
reference's largest magnitude. The last lines estimate Qwen3-8B's batch-1 decode from the
one-row times: 36 layers of the four projections plus the lm_head, against reading
those weights at the copy rate.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from vllmpy.ops import fp8_gemm, int4_gemm
from vllmpy.ops.fp8_gemm import (
    FP8_DTYPE,
    fp8_block_linear,
    fp8_block_linear_ref,
    fp8_scaled_linear,
    fp8_scaled_linear_ref,
)
from vllmpy.ops.int4_gemm import int4_linear, int4_linear_ref, pack_int4

SHAPES = {  # name -> (N, K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
    "down": (4096, 12288), "lm_head": (151936, 4096),
}
LAYERS = 36
COPY_RATE = 4.27e12  # the H200's measured HBM copy rate, bytes/s
L2_CLEAR_BYTES = 256 << 20
ERROR_ROWS = 256


def gpu_us(fn, reps: int = 20) -> float:
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
    for _ in range(3):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (3 * reps)


def copies_of(make, nbytes: int, m: int) -> list:
    """The weights a case cycles through: enough copies to exceed L2 for one row."""
    count = max(1, L2_CLEAR_BYTES // nbytes) if m == 1 else 1
    return [make() for _ in range(count)]


def cycling(items: list):
    turn = itertools.count()
    return lambda: items[next(turn) % len(items)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fp8_block_weight(n: int, k: int):
    w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    ws = torch.rand((n + 127) // 128, (k + 127) // 128, device="cuda") * 1e-3 + 1e-4
    return w, ws


def fp8_channel_weight(n: int, k: int):
    w = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    return w, torch.rand(n, 1, device="cuda") * 1e-3 + 1e-4


def int4_weight(n: int, k: int):
    codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.uint8)
    scales = (torch.rand(n, k // 128, device="cuda") * 1e-2).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.uint8)
    return pack_int4(codes, scales, zeros, 128)


def run_case(kind: str, name: str, m: int, rows: list) -> None:
    n, k = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xe = x[:ERROR_ROWS]
    if kind == "bf16":
        nbytes = 2 * n * k
        ws = copies_of(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                       nbytes, m)
        pick = cycling(ws)
        us = gpu_us(lambda: F.linear(x, pick()))
        err = 0.0
    elif kind in ("fp8 block", "fp8 scaled"):
        make = fp8_block_weight if kind == "fp8 block" else fp8_channel_weight
        op = fp8_block_linear if kind == "fp8 block" else fp8_scaled_linear
        ref = fp8_block_linear_ref if kind == "fp8 block" else fp8_scaled_linear_ref
        w0, s0 = make(n, k)
        nbytes = w0.numel() + s0.numel() * 4
        ws = [(w0, s0)] + copies_of(lambda: make(n, k), nbytes, m)[1:]
        pick = cycling(ws)
        us = gpu_us(lambda: op(x, *pick()))
        err = rel_error(op(xe, w0, s0), ref(xe, w0, s0))
    else:  # int4
        w0 = int4_weight(n, k)
        nbytes = w0.nbytes
        ws = [w0] + copies_of(lambda: int4_weight(n, k), nbytes, m)[1:]
        pick = cycling(ws)
        us = gpu_us(lambda: int4_linear(x, pick()))
        err = rel_error(int4_linear(xe, w0), int4_linear_ref(xe, w0))
    gbs = nbytes / us / 1e3
    tflops = 2 * m * n * k / us / 1e6
    rows.append((kind, name, m, us, gbs, tflops, err))
    print(f"{kind:10} {name:8} M={m:<5} {us:9.2f} us {gbs:8.0f} GB/s {tflops:7.1f} TFLOP/s "
          f"err {err:.1e}", flush=True)
    del ws
    torch.cuda.empty_cache()


def sweep() -> None:
    """The one-row block-scaled GEMV on each projection, over launch configurations."""
    print("\none-row fp8 block GEMV: (rows a program, chunk, warps) -> us per projection")
    default = fp8_gemm.GEMV_BLOCK_N, fp8_gemm.GEMV_CHUNK, fp8_gemm.GEMV_WARPS
    results = []
    for cfg in itertools.product((8, 16, 32), (512, 1024, 2048), (2, 4, 8)):
        fp8_gemm.GEMV_BLOCK_N, fp8_gemm.GEMV_CHUNK, fp8_gemm.GEMV_WARPS = cfg
        times = []
        try:
            for name in ("qkv", "o", "gate_up", "down"):
                n, k = SHAPES[name]
                x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                ws = copies_of(lambda n=n, k=k: fp8_block_weight(n, k), n * k, 1)
                pick = cycling(ws)
                times.append(gpu_us(lambda x=x, pick=pick: fp8_block_linear(x, *pick())))
        except Exception as exc:  # a configuration the compiler rejects
            print(f"  {cfg} failed: {type(exc).__name__}")
            continue
        results.append((sum(times), cfg, times))
    fp8_gemm.GEMV_BLOCK_N, fp8_gemm.GEMV_CHUNK, fp8_gemm.GEMV_WARPS = default
    print(f"  default {default}")
    for total, cfg, times in sorted(results)[:8]:
        print(f"  {cfg}: " + " ".join(f"{t:7.2f}" for t in times) + f"  sum {total:7.2f}")


def sweep_int4() -> None:
    """The one-row packed int4 GEMV on each projection, over launch configurations, beside
    the fp32 GEMV (the float32-activation path) on the same weights."""
    print("\none-row int4 f16x2 GEMV: (byte rows a program, chunk, warps) -> us per projection")
    default = int4_gemm.F16X2_BLOCK_J, int4_gemm.F16X2_CHUNK, int4_gemm.F16X2_WARPS
    cases = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = SHAPES[name]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = copies_of(lambda n=n, k=k: int4_weight(n, k), n * k // 2, 1)
        cases[name] = (x, ws)
    picks = [(x, cycling(ws)) for x, ws in cases.values()]
    fp32 = [gpu_us(lambda x=x, p=p: int4_gemm._launch_gemv(x, p(), None)) for x, p in picks]
    results = []
    for cfg in itertools.product((8, 16, 32), (512, 1024, 2048), (2, 4, 8)):
        int4_gemm.F16X2_BLOCK_J, int4_gemm.F16X2_CHUNK, int4_gemm.F16X2_WARPS = cfg
        try:
            times = [gpu_us(lambda x=x, p=p: int4_linear(x, p())) for x, p in picks]
        except Exception as exc:  # a configuration the compiler rejects
            print(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        results.append((sum(times), cfg, times))
    int4_gemm.F16X2_BLOCK_J, int4_gemm.F16X2_CHUNK, int4_gemm.F16X2_WARPS = default
    nbytes = [w[0].nbytes for _, w in cases.values()]
    print(f"  default {default}; the fp32 GEMV: " + " ".join(f"{t:7.2f}" for t in fp32))
    for total, cfg, times in sorted(results)[:10]:
        print(f"  {cfg}: " + " ".join(f"{t:7.2f}" for t in times) + f"  sum {total:7.2f}  "
              + " ".join(f"{b / t / 1e3:5.0f}" for b, t in zip(nbytes, times)) + " GB/s")


STREAM_PROLOGUES = {"qkv": "norm", "o": "plain", "gate_up": "norm", "down": "silu"}


def sweep_stream() -> None:
    """A decode step's four projections through the one-row streaming kernel in the fused
    forms the layers call (norm + qkv, o, norm + gate_up, SiLU + down): bf16 weights, and
    fp8 weights with 128 x 128 block scales at the default launches and over launch
    shapes; beside the fp8 block GEMV (unfused) on the same weights."""
    from vllmpy.ops import skinny_gemm as sk

    print("\none-row streaming kernel: us per projection (qkv o gate_up down), GB/s")
    prologue = {"norm": sk.RMS_NORM, "plain": sk.PLAIN, "silu": sk.SILU_MUL}
    cases = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = SHAPES[name]
        kind = STREAM_PROLOGUES[name]
        width = 2 * k if kind == "silu" else k
        x = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        bf16 = copies_of(lambda n=n, k=k: torch.randn(n, k, device="cuda",
                                                      dtype=torch.bfloat16), 2 * n * k, 1)
        fp8 = copies_of(lambda n=n, k=k: fp8_block_weight(n, k), n * k, 1)
        cases[name] = (n, k, prologue[kind], x, res, nw, bf16, fp8)

    def launch(case, weight, scale, shape):
        n, k, pro, x, res, nw, *_ = case
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        total = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
        norm = pro == sk.RMS_NORM
        sk._launch(x, res if norm else None, nw if norm else None, total if norm else None,
                   weight, None, out, pro, 1e-6 if norm else 0.0, *shape, scale=scale)

    def times(fp8: bool, shape=(None, None, None)) -> list[float]:
        result = []
        for case in cases.values():
            weights = case[7] if fp8 else case[6]
            pick = cycling(weights)
            if fp8:
                def call(case=case, pick=pick):
                    w, s = pick()
                    launch(case, w, sk.WeightScale(s, (128, 128)), shape)
            else:
                def call(case=case, pick=pick):
                    launch(case, pick(), None, shape)
            result.append(gpu_us(call))
        return result

    def show(label: str, ts: list[float], fp8: bool) -> None:
        per = [n * k * (1 if fp8 else 2) for n, k, *_ in cases.values()]
        print(f"  {label:28}" + " ".join(f"{t:7.2f}" for t in ts) + f"  sum {sum(ts):7.2f}  "
              + " ".join(f"{b / t / 1e3:5.0f}" for b, t in zip(per, ts)) + " GB/s")

    show("bf16 default", times(False), False)
    show("fp8 default", times(True), True)
    gemv = []
    for name, case in cases.items():
        n, k = SHAPES[name]
        pick = cycling(case[7])
        xk = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemv.append(gpu_us(lambda xk=xk, pick=pick: fp8_block_linear(xk, *pick())))
    show("fp8 block GEMV (unfused)", gemv, True)
    results = []
    for shape in ((8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (8, 4096, 8), (16, 1024, 4),
                  (16, 1024, 8), (16, 2048, 8), (4, 2048, 4)):  # (rows, chunk, warps)
        try:
            results.append((sum(ts := times(True, (*shape, 3))), shape, ts))
        except Exception as exc:  # a configuration the compiler rejects
            print(f"  {shape} failed: {type(exc).__name__}: {str(exc)[:200]}")
    for _, shape, ts in sorted(results)[:8]:
        show(f"fp8 {shape}", ts, True)
    # per projection, the best shape of all
    best = [min((r[2][i], r[1]) for r in results) for i in range(4)] if results else []
    print("  best per projection: " + ", ".join(f"{name} {t:.2f} us {shape}" for name, (t, shape)
                                                in zip(cases, best)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true",
                        help="also time the one-row fp8 GEMV's launch configurations")
    parser.add_argument("--sweep-int4", action="store_true",
                        help="also time the one-row int4 GEMV's launch configurations")
    parser.add_argument("--sweep-stream", action="store_true",
                        help="also time the one-row streaming kernel on bf16 and fp8 weights")
    parser.add_argument("--only-sweeps", action="store_true", help="skip the table")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = [("fp8 block", (1, 256, 8192)), ("fp8 scaled", (1, 256, 8192)),
             ("int4", (1, 256)), ("bf16", (1, 256, 8192))]
    rows: list = []
    if args.sweep_int4:
        sweep_int4()
    if args.sweep_stream:
        sweep_stream()
    if args.only_sweeps:
        if args.sweep:
            sweep()
        return
    for kind, ms in cases:
        for m in ms:
            for name in SHAPES:
                run_case(kind, name, m, rows)
    if args.sweep:
        sweep()

    print(f"\n{'kind':10} {'shape':8} {'M':>5} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8} "
          f"{'vs bf16':>8} {'err':>8}")
    bf16 = {(name, m): us for kind, name, m, us, *_ in rows if kind == "bf16"}
    for kind, name, m, us, gbs, tflops, err in rows:
        speedup = bf16.get((name, m), float("nan")) / us
        print(f"{kind:10} {name:8} {m:>5} {us:9.2f} {gbs:7.0f} {tflops:8.1f} "
              f"{speedup:7.2f}x {err:8.1e}")
    print("\nQwen3-8B batch-1 decode, linear layers only (36 layers + lm_head):")
    for kind in ("fp8 block", "fp8 scaled", "int4", "bf16"):
        one = {name: (us, gbs) for k_, name, m, us, gbs, *_ in rows if k_ == kind and m == 1}
        per_token = sum(one[n][0] for n in ("qkv", "o", "gate_up", "down")) * LAYERS
        per_token += one["lm_head"][0]
        nbytes = sum(one[n][0] * one[n][1] * 1e3 for n in ("qkv", "o", "gate_up", "down"))
        nbytes = nbytes * LAYERS + one["lm_head"][0] * one["lm_head"][1] * 1e3
        roof = nbytes / COPY_RATE * 1e6
        print(f"  {kind:10} {per_token:8.0f} us a token, roofline {roof:8.0f} us: "
              f"{roof / per_token:6.1%}")


if __name__ == "__main__":
    main()
