"""Does a batch-1 decode's step time follow the GPU's clocks? Runs batch-1 generations
(dummy weights, greedy, ignore_eos) through ``LLM`` while ``nvidia-smi`` samples the SM
and memory clocks, the power draw, the temperature and the active clock-event reasons
every 20 ms, and prints for each block of steps its mean step time beside the samples
taken during it.

    python benchmarks/investigations/clock_trace.py --out DIR [--model qwen3-8b] [--runs 512:1024,640:256]

Each run is PROMPT:OUTPUT tokens, after ``--idle`` seconds with the GPU idle. The raw
samples and step times land in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
          "clocks_event_reasons.active")


class Sampler:
    """``nvidia-smi`` in the background; each line stamped with the host's clock."""

    def __init__(self, period_ms: int) -> None:
        self.samples: list[tuple[float, list[str]]] = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
             f"-lms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.samples.append((time.perf_counter(), [v.strip() for v in line.split(",")]))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()

    def between(self, t0: float, t1: float) -> list[list[str]]:
        return [v for t, v in self.samples if t0 <= t < t1]


def _num(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        return float("nan")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--runs", default="512:1024,640:256")
    p.add_argument("--block", type=int, default=32, help="steps per printed line")
    p.add_argument("--idle", type=float, default=3.0)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import numpy as np

    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    llm = LLM(model=os.path.join(BENCH_DIR, "configs", args.model), load_format="dummy",
              device="cuda", dtype="bfloat16", num_blocks=1024, max_num_seqs=32,
              max_num_batched_tokens=8192)
    rng = np.random.default_rng(0)
    warm = {"prompt_token_ids": rng.integers(100, 10000, 512).tolist()}
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)

    stamps: list[float] = []
    step = llm._step

    def stamped(*a, **k):
        try:
            return step(*a, **k)
        finally:
            stamps.append(time.perf_counter())
    llm._step = stamped  # type: ignore[method-assign]

    sampler = Sampler(20)
    time.sleep(1.0)
    report = []
    for spec in args.runs.split(","):
        prompt_len, output_len = (int(v) for v in spec.split(":"))
        time.sleep(args.idle)
        stamps.clear()
        prompt = {"prompt_token_ids": rng.integers(100, 10000, prompt_len).tolist()}
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output_len,
                                              ignore_eos=True), use_tqdm=False)
        steps = [start, *stamps]
        print(f"\nrun {spec}: {len(stamps)} steps, "
              f"{(steps[-1] - steps[1]) / max(1, len(steps) - 2) * 1e3:.3f} ms a step "
              f"after the first")
        print(f"{'steps':>11} {'ms/step':>8} {'SM MHz':>13} {'mem MHz':>8} {'W':>12} "
              f"{'C':>4}  reasons")
        for i in range(1, len(steps) - 1, args.block):
            j = min(i + args.block, len(steps) - 1)
            t0, t1 = steps[i], steps[j]
            got = sampler.between(t0, t1)
            sm = [_num(v[0]) for v in got]
            mem = [_num(v[1]) for v in got]
            watts = [_num(v[2]) for v in got]
            temp = [_num(v[3]) for v in got]
            reasons = sorted({v[4] for v in got})
            line = {"run": spec, "steps": [i, j], "ms_per_step": (t1 - t0) / (j - i) * 1e3,
                    "sm_mhz": sm, "mem_mhz": mem, "watts": watts, "temp": temp,
                    "reasons": reasons}
            report.append(line)
            if sm:
                print(f"{i:>5}-{j:<5} {line['ms_per_step']:>8.3f} "
                      f"{min(sm):>6.0f}-{max(sm):<6.0f} {sum(mem) / len(mem):>8.0f} "
                      f"{min(watts):>5.0f}-{max(watts):<6.0f} {max(temp):>4.0f}  "
                      f"{' '.join(reasons)}")
            else:
                print(f"{i:>5}-{j:<5} {line['ms_per_step']:>8.3f}  (no samples)")
    sampler.stop()
    with open(os.path.join(args.out, "clock_trace.json"), "w") as f:
        json.dump({"report": report, "samples": sampler.samples}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
