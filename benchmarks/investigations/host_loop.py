"""Is a batch-1 decode bound by the GPU or by the host? The P2 workload (1 x 512 in /
256 out, greedy, dummy weights) through ``LLM`` with the engine loop's phases timed on the
host: scheduling, launching a step, waiting for a step's sampled ids, recording them, and
the frontend's output processing. Also times the decode graph's replay alone (the device
floor of a step's forward and logits). A step whose wait is near zero is host-bound.

    python benchmarks/investigations/host_loop.py [--model qwen3-0.6b] [--layers 28] [--repeat N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=0, help="0: the config's own count")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed generations; with more than one, a line per generation "
                        "tells a slow one's host time from its GPU time")
    args = p.parse_args()

    import numpy as np
    import torch
    from layer_slope import config_with_layers  # a sibling script (benchmarks/investigations/)

    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    tmp = tempfile.mkdtemp(prefix="host_loop-")
    cfg_dir = config_with_layers(args.model, args.layers, tmp)
    with open(os.path.join(cfg_dir, "config.json")) as f:
        num_layers = json.load(f)["num_hidden_layers"]
    llm = LLM(model=cfg_dir, load_format="dummy", device=args.device, dtype="bfloat16",
              num_blocks=512, max_num_seqs=32, max_num_batched_tokens=8192)
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(0)
    prompt = {"prompt_token_ids": rng.integers(100, 10000, 512).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up

    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key].append(time.perf_counter() - t)
        setattr(obj, name, wrapper)

    core = llm.engine.engine_core
    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update_from_output")
    timed(core.model_runner, "launch", "launch")
    timed(core.model_runner, "_finish_step", "finish_step (incl. wait)")
    timed(torch.cuda.Event, "synchronize", "event waits")
    timed(llm.output_processor, "process_outputs", "frontend process_outputs")
    timed(llm, "_step", "LLM step (all)")
    runner = core.model_runner
    for name in ("_update_states", "_stage", "_fill_rows", "_sampling_metadata",
                 "_copy_to_host"):
        timed(runner, name, f"  launch: {name}")
    timed(runner.input_batch, "prepare", "  launch: input_batch.prepare")
    timed(runner.sampler, "sample", "  launch: sampler.sample")
    if runner.graphs is not None:
        timed(runner.graphs, "run", "  launch: graphs.run")
        timed(torch.cuda.CUDAGraph, "replay", "    graphs.run: replay")

    def replay_alone() -> float:
        """µs per replay of the smallest decode graph, nothing else running."""
        graphs = core.model_runner.graphs
        if graphs is None:
            return float("nan")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            graphs.graphs[graphs.sizes[0]].replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / 100 * 1e6

    def per_step(key: str, marks: dict[str, tuple[int, float]]) -> float:
        """µs per call of ``key`` since ``marks`` (calls and total time at a point)."""
        n0, s0 = marks.get(key, (0, 0.0))
        vals = times.get(key, [])
        return (sum(vals) - s0) / max(len(vals) - n0, 1) * 1e6

    walls = []
    for turn in range(args.repeat):
        marks = {key: (len(v), sum(v)) for key, v in times.items()}
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        if args.repeat > 1:
            print(f"  generation {turn}: {walls[-1] / args.output_len * 1e6:7.1f} us per "
                  f"token; per step: launch {per_step('launch', marks):6.1f} us, event "
                  f"waits {per_step('event waits', marks):6.1f} us, schedule "
                  f"{per_step('schedule', marks):5.1f} us, frontend "
                  f"{per_step('frontend process_outputs', marks):5.1f} us; graph replay "
                  f"alone after it {replay_alone():6.1f} us", flush=True)
    wall = sorted(walls)[len(walls) // 2]

    replay_us = replay_alone()
    steps = len(times["LLM step (all)"])
    if args.device == "cuda":  # host cost of single calls, the GPU idle
        x = torch.randn(1, 151936, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, dtype=torch.int64, device="cuda")
        pinned = torch.zeros(5, 32, dtype=torch.int64, pin_memory=True)
        dev = torch.zeros(5, 32, dtype=torch.int64, device="cuda")
        for label, fn in (("argmax(out=)", lambda: torch.argmax(x, dim=-1, out=out)),
                          ("H2D copy_ 1 KiB", lambda: dev.copy_(pinned, non_blocking=True)),
                          ("Event() + record", lambda: torch.cuda.Event().record()),
                          ("current_stream", torch.cuda.current_stream)):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            dt = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"  host cost of {label}: {dt:.1f} us")
    name = f"{args.model} {num_layers}L"
    print(f"{name}: {steps} steps, {wall / args.output_len * 1e6:.1f} us per token, "
          f"graph replay alone {replay_us:.1f} us")
    for key, vals in times.items():
        v = np.array(vals) * 1e6
        print(f"  {key:<28} calls {len(v):>4}  per step {v.sum() / steps:>8.1f} us  "
              f"median {np.median(v):>7.1f}  p90 {np.percentile(v, 90):>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
