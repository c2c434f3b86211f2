"""Time one MoE layer's experts for a decode step on the GPU: the grouped GEMMs
(``vllmpy.ops.fused_moe``) against the one-row kernels (``vllmpy.ops.moe_decode``) at a few
launch shapes, and the router's ``select_experts``; Qwen3-30B-A3B's shapes by default.

    python benchmarks/investigations/moe_kernels.py [--tokens 1] [--layers 4]

Each variant runs ``--layers`` layers (distinct weights and routings, so the working set
is well past L2) inside one CUDA graph, replayed; the table gives microseconds per layer
and the chosen experts' weight bytes over that time.
"""

from __future__ import annotations

import argparse

import torch

from vllmpy.layers.moe import select_experts
from vllmpy.ops.fused_moe import fused_moe
from vllmpy.ops.moe_decode import moe_decode


def _graph_time(fn, replays: int = 50) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    e, h, i, t, k = args.experts, args.hidden, args.inter, args.tokens, args.top_k
    layers = []
    for seed in range(args.layers):
        g = torch.Generator(device=dev).manual_seed(seed)
        w13 = torch.randn(e, 2 * i, h, device=dev, generator=g, dtype=dt) * 0.02
        w2 = torch.randn(e, h, i, device=dev, generator=g, dtype=dt) * 0.02
        gate = torch.randn(e, h, device=dev, generator=g, dtype=dt) * 0.02
        x = torch.randn(t, h, device=dev, generator=g, dtype=dt)
        weights, ids = select_experts(torch.randn(t, e, device=dev, generator=g), k, True)
        layers.append((x, w13, w2, gate, weights, ids))
    ref = [fused_moe(x, w13, w2, wt, ids, rows=False) for x, w13, w2, _, wt, ids in layers]
    chosen = sum(len(set(ids.reshape(-1).tolist())) for *_, ids in layers) / len(layers)
    layer_bytes = chosen * 3 * i * h * 2

    variants = {"grouped GEMM (fused_moe)": lambda x, w13, w2, wt, ids: fused_moe(
        x, w13, w2, wt, ids, rows=False)}
    shapes = [((16, 16), 256, 4), ((8, 8), 256, 4), ((16, 16), 512, 4), ((32, 16), 256, 8),
              ((16, 8), 128, 4), ((8, 16), 512, 8), ((4, 8), 512, 4)]
    for bn, bk, warps in shapes:
        variants[f"rows n={bn} k={bk} w={warps}"] = (
            lambda x, w13, w2, wt, ids, bn=bn, bk=bk, warps=warps: moe_decode(
                x, w13, w2, wt, ids, block_n=bn, block_k=bk, num_warps=warps))
    rows = []
    for name, fn in variants.items():
        outs = [fn(x, w13, w2, wt, ids) for x, w13, w2, _, wt, ids in layers]
        err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, ref))
        us = _graph_time(lambda fn=fn: [fn(x, w13, w2, wt, ids)
                                        for x, w13, w2, _, wt, ids in layers])
        rows.append((name, us / len(layers), layer_bytes / (us / len(layers)) / 1e3, err))
    route_us = _graph_time(lambda: [select_experts(x @ gate.T, k, True)
                                    for x, _, _, gate, _, _ in layers]) / len(layers)
    print(f"experts E={e} top-{k} H={h} I={i} tokens={t}: {chosen:.1f} experts a layer, "
          f"{layer_bytes / 1e6:.1f} MB of their weights")
    print(f"{'variant':<34}{'us/layer':>10}{'GB/s':>9}{'max|diff|':>11}")
    for name, us, gbs, err in sorted(rows, key=lambda r: r[1]):
        print(f"{name:<34}{us:>10.1f}{gbs:>9.0f}{err:>11.2e}")
    print(f"{'router (gate GEMV + select_experts)':<34}{route_us:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
