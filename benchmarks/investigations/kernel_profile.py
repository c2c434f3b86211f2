"""Per-kernel GPU time of one decode forward (eager, the same kernels the CUDA graph
replays), so the graph's time can be split by kernel.

    python benchmarks/investigations/kernel_profile.py --out DIR [--model qwen3-0.6b] [--batch 1] [--seq 768]
"""

from __future__ import annotations

import argparse
import os
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=768)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from vllmpy.engine.llm import LLM

    n, bs = args.batch, 32
    per_seq = -(-args.seq // bs)
    llm = LLM(model=os.path.join(BENCH_DIR, "configs", args.model), load_format="dummy",
              device="cuda", dtype="bfloat16", num_blocks=n * per_seq + 64,
              max_num_seqs=max(n, 1), max_num_batched_tokens=8192)
    runner = llm.engine.engine_core.model_runner
    graphs = runner.graphs
    size = next(s for s in graphs.sizes if s >= n)
    graphs.seq_lens[:n] = args.seq
    graphs.positions[:n] = args.seq - 1
    graphs.slot_mapping[:n] = -1
    graphs.block_tables[:n, :per_seq] = torch.arange(n * per_seq, dtype=torch.int32,
                                                     device="cuda").view(n, per_seq)
    graphs.query_start_loc[n + 1:size + 1] = n
    meta = graphs._meta(size)
    ids, pos = graphs.input_ids[:size], graphs.positions[:size]
    with torch.inference_mode():
        for _ in range(3):
            runner.model(ids, pos, meta)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            graphs.graphs[size].replay()
        torch.cuda.synchronize()
        replay_ms = (time.perf_counter() - t) / 20 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.model(ids, pos, meta)
                runner.model.compute_logits(runner.model(ids, pos, meta)[:n])
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                      max_name_column_width=70)
    name = f"kernels_{args.model}_b{n}_s{args.seq}.txt"
    with open(os.path.join(args.out, name), "w") as f:
        f.write(table)
    total_us = sum(e.device_time_total for e in prof.key_averages()) / 10
    print(f"{args.model} b={n} seq={args.seq} replay_ms={replay_ms:.3f} "
          f"eager_kernel_sum_per_fwd_ms={total_us / 1e3:.3f}")
    print("\n".join(table.splitlines()[:22]))


if __name__ == "__main__":
    main()
