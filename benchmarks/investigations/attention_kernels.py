"""Decode attention speed of the Triton paged-attention kernel against the torch reference.

Qwen3-8B head geometry (32 query heads, 8 KV heads, head_dim 128), bf16, block size 32,
each request's blocks scattered over the pool. Reports the median time of one layer's
attention, the KV bytes it reads per second against the device's memory bandwidth, and
the reference backend's time for the same batch.

    python benchmarks/investigations/attention_kernels.py            # the two headline cases
    python benchmarks/investigations/attention_kernels.py --sweep    # also split counts and launch shapes
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton
import triton.testing

from vllmpy.attention.backend import TorchReferenceBackend
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.ops.paged_attention import (
    AttentionKernelConfig,
    choose_num_splits,
    default_config,
    num_multiprocessors,
    paged_attention,
)

HEADS, KV_HEADS, DIM, BLOCK, DTYPE = 32, 8, 128, 32, torch.bfloat16
PEAK_GBS = 4300.0  # device-to-device copy rate of an H200, counting reads and writes


def make_decode_batch(batch: int, context: int, device: torch.device) -> dict:
    blocks_per_req = -(-context // BLOCK)
    num_blocks = batch * blocks_per_req
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, dtype=DTYPE, device=device)
    # [batch, blocks_per_req], a random permutation of the pool
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, -1)
    return dict(
        q=torch.randn(batch, HEADS, DIM, dtype=DTYPE, device=device), kv_cache=cache,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        block_tables=tables)


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * KV_HEADS * DIM * 2 * DTYPE.itemsize  # keys and values


def time_triton(b: dict, context: int, num_splits=None, config=None) -> float:
    out = torch.empty_like(b["q"])

    def run():
        paged_attention(out=out, scale=1 / math.sqrt(DIM), max_query_len=1,
                        max_seq_len=context, num_splits=num_splits, config=config, **b)

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")


def time_graph(b: dict, context: int, num_splits=None) -> float:
    """One launch replayed from a CUDA graph: no Python or launch overhead, L2 kept warm."""
    out = torch.empty_like(b["q"])

    def run():
        paged_attention(out=out, scale=1 / math.sqrt(DIM), max_query_len=1,
                        max_seq_len=context, num_splits=num_splits, **b)

    return triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")


def host_us_per_call(b: dict, context: int, calls: int = 500) -> float:
    """Wall time of the launcher on the host (checks, scratch allocation, launches)."""
    out = torch.empty_like(b["q"])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        paged_attention(out=out, scale=1 / math.sqrt(DIM), max_query_len=1,
                        max_seq_len=context, **b)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def time_reference(b: dict, batch: int, context: int) -> tuple[float, torch.Tensor]:
    backend = TorchReferenceBackend(HEADS, KV_HEADS, DIM, 1 / math.sqrt(DIM))
    slots = torch.full((0,), 0, dtype=torch.int64, device=b["q"].device)
    meta = AttentionMetadata(
        num_actual_tokens=0, query_start_loc=b["query_start_loc"],
        query_start_loc_cpu=list(range(batch + 1)), seq_lens=b["seq_lens"],
        seq_lens_cpu=[context] * batch, slot_mapping=slots, block_tables=b["block_tables"],
        block_size=BLOCK)
    empty = b["q"][:0, :KV_HEADS]  # no new keys: the cache is already filled

    def run():
        return backend.forward(b["q"], empty, empty, b["kv_cache"], meta)

    return triton.testing.do_bench(run, warmup=5, rep=100, return_mode="median"), run()


def report(name: str, ms: float, nbytes: int) -> None:
    gbs = nbytes / ms / 1e6
    print(f"  {name:<34} {ms * 1e3:9.1f} us {gbs:8.0f} GB/s  {100 * gbs / PEAK_GBS:5.1f}% of peak")


def headline(batch: int, context: int, device: torch.device) -> dict:
    b = make_decode_batch(batch, context, device)
    nbytes = kv_bytes(batch, context)
    splits = choose_num_splits(batch * KV_HEADS, context, num_multiprocessors(device))
    print(f"decode batch {batch} x {context} context: {nbytes / 1e6:.0f} MB of KV, "
          f"{splits} split(s)")
    report("triton (do_bench, L2 flushed)", time_triton(b, context), nbytes)
    report("triton (CUDA graph replay)", time_graph(b, context), nbytes)
    print(f"  launcher host time: {host_us_per_call(b, context):.1f} us per call")
    ref_ms, ref_out = time_reference(b, batch, context)
    report("torch reference backend", ref_ms, nbytes)
    out = torch.empty_like(b["q"])
    paged_attention(out=out, scale=1 / math.sqrt(DIM), max_query_len=1, max_seq_len=context, **b)
    print(f"  max |triton - reference| = {(out.float() - ref_out.float()).abs().max().item():.2e}")
    return b


def sweep_splits(b: dict, batch: int, context: int) -> None:
    nbytes = kv_bytes(batch, context)
    print(f"  split counts, batch {batch} x {context}, CUDA graph replay:")
    for splits in (1, 2, 4, 8, 16, 32, 64):
        if splits * 64 <= context:
            report(f"splits={splits}", time_graph(b, context, num_splits=splits), nbytes)


def sweep_configs(b: dict, batch: int, context: int, fp8: bool = False) -> None:
    """Decode launch shapes over bf16 pages, or over fp8 pages (half the bytes)."""
    nbytes = kv_bytes(batch, context) // (2 if fp8 else 1)
    print(f"  {'fp8 ' if fp8 else ''}launch shapes, batch {batch} x {context}:")
    base = default_config(1, HEADS, KV_HEADS, DIM, fp8=fp8)
    for tile_n in (32, 64, 128):
        for warps in (4, 8) if fp8 else (2, 4, 8):
            for stages in (2, 3, 4):
                cfg = AttentionKernelConfig(base.block_m, tile_n, warps, stages)
                try:
                    ms = time_triton(b, context, config=cfg)
                except Exception as exc:  # a shape the compiler cannot fit
                    print(f"  tile_n={tile_n} warps={warps} stages={stages}: {type(exc).__name__}")
                    continue
                report(f"tile_n={tile_n} warps={warps} stages={stages}", ms, nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time split counts and shapes")
    parser.add_argument("--cases", default="1x4096,64x1024,1x32768",
                        help="decode batches as BATCHxCONTEXT, comma-separated")
    parser.add_argument("--fp8", action="store_true", help="also time an fp8 (e4m3) cache")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        b = headline(batch, context, device)
        if args.fp8:
            fp8 = {**b, "kv_cache": b["kv_cache"].to(torch.float8_e4m3fn)}
            report("triton fp8 cache (CUDA graph replay)", time_graph(fp8, context),
                   kv_bytes(batch, context) // 2)
            if args.sweep:
                sweep_splits(fp8, batch, context)
                sweep_configs(fp8, batch, context, fp8=True)
        if args.sweep:
            sweep_splits(b, batch, context)
            if context <= 4096:
                sweep_configs(b, batch, context)


if __name__ == "__main__":
    main()
