"""Batch-1 decode attention per layer: the separate launches (q/k norm + rotary with the
cache write, paged attention, split merge) against the one-launch decode attention
(vllmpy.ops.decode_attention) at several ``min_tiles_per_split``.

Each case captures one CUDA graph of ``--layers`` calls, each over its own layer's cache
(as a model's layers are: no call finds the previous one's keys in L2), replays it, and
reports microseconds per layer. Qwen3 geometry, bf16, 32-token blocks, the split count the
decode graphs use at max_model_len 40,960.

    python benchmarks/investigations/decode_attention_sweep.py [--contexts 768,4096] [--layers 28]
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

from vllmpy.ops.decode_attention import decode_attention
from vllmpy.ops.fused import qk_norm_rotary
from vllmpy.ops.paged_attention import choose_num_splits, num_multiprocessors, paged_attention

GEOMETRIES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
BLOCK = 32
MAX_MODEL_LEN = 40960


def layer_inputs(heads, kv_heads, dim, context, layers, dev):
    blocks = -(-context // BLOCK)
    dt = torch.bfloat16
    caches = [torch.randn(2, blocks + 1, BLOCK, kv_heads, dim, device=dev, dtype=dt)
              for _ in range(layers)]
    table = torch.randperm(blocks + 1, device=dev)[:blocks].to(torch.int32)[None, :]
    last = context - 1
    slot = int(table[0, last // BLOCK]) * BLOCK + last % BLOCK
    return dict(
        caches=caches,
        qkv=torch.randn(1, (heads + 2 * kv_heads) * dim, device=dev, dtype=dt),
        positions=torch.tensor([last], device=dev),
        slots=torch.tensor([slot], device=dev),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=dev),
        query_start=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        table=table,
        cos_sin=torch.randn(MAX_MODEL_LEN, dim, device=dev),
        qw=torch.ones(dim, device=dev, dtype=dt), kw=torch.ones(dim, device=dev, dtype=dt),
    )


def time_graph(fn, replays=200) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays  # us per replay


def run_separate(x: dict, heads: int, kv_heads: int, dim: int, splits: int) -> None:
    """Every layer: q/k norm + rotary with the cache write, then paged attention."""
    for cache in x["caches"]:
        q, k, v = x["qkv"].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = qk_norm_rotary(x["positions"], q, k, x["qw"], x["kw"], 1e-6, x["cos_sin"],
                              dim, v, cache, x["slots"])
        out = torch.empty(1, heads, dim, device=q.device, dtype=q.dtype)
        paged_attention(q.view(1, heads, dim), cache, out, x["query_start"], x["seq_lens"],
                        x["table"], scale=1 / math.sqrt(dim), max_query_len=1,
                        max_seq_len=MAX_MODEL_LEN, num_splits=splits)


def run_fused(x: dict, heads: int, dim: int, splits: int, min_tiles: int) -> None:
    """Every layer: the one-launch decode attention."""
    for cache in x["caches"]:
        decode_attention(x["qkv"], x["positions"], x["cos_sin"], cache, x["slots"],
                         x["seq_lens"], x["table"], num_heads=heads, scale=1 / math.sqrt(dim),
                         max_seq_len=MAX_MODEL_LEN, q_norm_weight=x["qw"],
                         k_norm_weight=x["kw"], eps=1e-6, num_splits=splits,
                         min_tiles_per_split=min_tiles)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="768,4096")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--min-tiles", default="1,2,4,8,16")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (heads, kv_heads, dim) in GEOMETRIES.items():
        splits = choose_num_splits(kv_heads, MAX_MODEL_LEN, num_multiprocessors(dev))
        for context in map(int, args.contexts.split(",")):
            x = layer_inputs(heads, kv_heads, dim, context, args.layers, dev)
            cases = [("separate (3 launches)",
                      functools.partial(run_separate, x, heads, kv_heads, dim, splits))]
            cases += [(f"fused, min {mt} tiles/split",
                       functools.partial(run_fused, x, heads, dim, splits, mt))
                      for mt in map(int, args.min_tiles.split(","))]
            for label, fn in cases:
                us = time_graph(fn) / args.layers
                rows.append((name, context, label, us))
                print(f"{name:11s} ctx {context:5d} splits {splits:2d}  {label:26s} "
                      f"{us:6.2f} us/layer", flush=True)
    print("\nmodel       context  case                        us/layer")
    for name, context, label, us in rows:
        print(f"{name:11s} {context:7d}  {label:26s} {us:8.2f}")


if __name__ == "__main__":
    main()
