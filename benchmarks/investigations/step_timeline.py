"""The GPU's side of steady decode steps: how much of each step the device is busy, what
runs outside the decode graph, and where the idle time sits.

Runs one request (or ``--batch`` requests) to the middle of its decode, then records
``--steps`` engine steps with the torch profiler (CPU and CUDA activity) and prints, per
step: wall time, GPU busy time (union of kernel and copy intervals), the idle gaps, and
the kernels and copies by name with their count and time per step.

    python benchmarks/investigations/step_timeline.py --out DIR [--model qwen3-8b] [--batch 1] [--steps 40]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def _intervals(events) -> list[tuple[float, float, str]]:
    out = []
    for e in events:
        if e.device_type.name != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    llm = LLM(model=os.path.join(BENCH_DIR, "configs", args.model), load_format="dummy",
              device="cuda", dtype="bfloat16", num_blocks=2048,
              max_num_seqs=max(args.batch, 1), max_num_batched_tokens=8192)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 4, ignore_eos=True)

    def add() -> None:
        for _ in range(args.batch):
            llm.add_request(
                {"prompt_token_ids": rng.integers(100, 10000, args.input_len).tolist()},
                params)

    llm.generate([{"prompt_token_ids": rng.integers(100, 10000, args.input_len).tolist()}],
                 SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    add()
    engine = llm  # vLLM's LLMEngine surface: add_request / step
    for _ in range(args.steps):  # prefill and the first decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()

    spans = _intervals(prof.events())
    busy, gaps = 0.0, []
    cur_s, cur_e = spans[0][0], spans[0][1]
    for s, e, _ in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    n = args.steps
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for s, e, name in spans:
        by_name[name].append(e - s)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    # Each interval's share of the critical path: how far it moves the latest end seen so
    # far. Under PDL a kernel starts before the one ahead of it ends, so its own duration
    # overstates what it adds to the step; this increment does not.
    chain: dict[str, float] = collections.defaultdict(float)
    latest = spans[0][0]
    for s, e, name in spans:
        chain[name] += max(0.0, e - max(s, latest))  # idle time before s is not counted
        latest = max(latest, e)
    chain_rows = sorted(chain.items(), key=lambda kv: -kv[1])
    # the one-row GEMMs by their place in a layer (qkv, o, gate_up, down in a decode step)
    gemm_slots = [0.0] * 4
    seen = 0
    latest = spans[0][0]
    for s, e, name in spans:
        if name == "_skinny_gemm_kernel":
            gemm_slots[seen % 4] += max(0.0, e - max(s, latest))
            seen += 1
        latest = max(latest, e)
    big_gaps = sorted(gaps, reverse=True)
    cpu = prof.key_averages()
    cpu_rows = sorted((a for a in cpu if a.device_type.name == "CPU"),
                      key=lambda a: -a.self_cpu_time_total)[:25]
    report = {
        "model": args.model, "batch": args.batch, "steps": n,
        "wall_ms_per_step": wall / n * 1e3,
        "gpu_busy_ms_per_step": busy / n / 1e3,
        "gpu_idle_ms_per_step": sum(gaps) / n / 1e3,
        "gaps_over_20us_per_step": sum(1 for g in gaps if g > 20) / n,
        "largest_gaps_us": [round(g, 1) for g in big_gaps[:12]],
        "kernels": [{"name": k[:90], "per_step": len(v) / n, "us_per_step": sum(v) / n}
                    for k, v in rows[:30]],
        "gemm_critical_path_by_place_us": [round(v / n, 1) for v in gemm_slots],
        "critical_path": [{"name": k[:90], "per_step": len(by_name[k]) / n,
                           "us_per_step": v / n} for k, v in chain_rows[:30]],
        "cpu_self": [{"name": a.key[:80], "calls_per_step": a.count / n,
                      "self_us_per_step": a.self_cpu_time_total / n} for a in cpu_rows],
    }
    path = os.path.join(args.out, f"timeline_{args.model}_b{args.batch}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{args.model} b{args.batch}: wall {report['wall_ms_per_step']:.3f} ms/step, GPU busy "
          f"{report['gpu_busy_ms_per_step']:.3f}, idle {report['gpu_idle_ms_per_step']:.3f} "
          f"({report['gaps_over_20us_per_step']:.1f} gaps > 20 us per step); largest gaps (us) "
          f"{report['largest_gaps_us'][:6]}")
    for k in report["kernels"][:14]:
        print(f"  {k['us_per_step']:9.1f} us {k['per_step']:6.1f}x  {k['name']}")
    print(f"  one-row GEMMs' critical path by place in the layer (qkv, o, gate_up, down), us "
          f"per step: {report['gemm_critical_path_by_place_us']}")
    print("  critical path (how far each kernel moves the step's end):")
    for k in report["critical_path"][:14]:
        print(f"  {k['us_per_step']:9.1f} us {k['per_step']:6.1f}x  {k['name']}")
    for a in report["cpu_self"][:12]:
        print(f"  cpu {a['self_us_per_step']:9.1f} us {a['calls_per_step']:6.1f}x  {a['name']}")


if __name__ == "__main__":
    main()
