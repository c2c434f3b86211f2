"""The KV-cache feature rows on the GPU, in one run:

- prefix caching: TTFT of a request whose 2,000-token system prompt is already cached,
  against the same request cold (Qwen3-8B, dummy weights);
- prefix caching at 0% reuse: the P3 workload with caching on and off;
- fp8 KV against bf16 KV: decode speed at 4k context (Qwen3-8B, 32 requests).

    python benchmarks/kv_features.py --out DIR [--parts ttft,p3,fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {m: os.path.join(HERE, "configs", m) for m in ("qwen3-0.6b", "qwen3-8b")}
P3_ARGS = ["--warmup", "32", "--num-prompts", "256", "--input-len", "100:1024", "--output-len", "100:1024",
           "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--num-blocks", "16384"]


def bench(name: str, model: str, extra: list[str], out_dir: str) -> dict:
    json_path = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "vllmpy.entrypoints.bench", "--model", CONFIGS[model],
           "--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
           "--output-json", json_path, *extra]
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not os.path.exists(json_path):
        return {"name": name, "rc": rc}
    with open(json_path) as f:
        res = json.load(f)
    summary = res.get("summary", res)
    keep = ("output_throughput", "total_token_throughput", "median_tpot_ms", "median_ttft_ms",
            "duration")
    return {"name": name, "rc": rc, **{k: summary.get(k) for k in keep}}


def ttft_rows() -> list[dict]:
    import numpy as np

    from vllmpy import LLM, SamplingParams

    llm = LLM(model=CONFIGS["qwen3-8b"], load_format="dummy", device="cuda", dtype="bfloat16",
              num_blocks=2048, max_num_batched_tokens=8192)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    # Warm-up, so no kernel compiles inside a timed request: a cold 2,020-token prompt and
    # then a hit on its cached prefix (a short chunk attending to a long cached context).
    other = rng.integers(1000, 100000, 2000).tolist()
    ttft(other + rng.integers(1000, 100000, 20).tolist())
    ttft(other + rng.integers(1000, 100000, 20).tolist())
    colds, warms = [], []
    for _ in range(5):  # a fresh system prompt each time: cold, then cached
        system = rng.integers(1000, 100000, 2000).tolist()
        colds.append(ttft(system + rng.integers(1000, 100000, 20).tolist()))
        warms.append(ttft(system + rng.integers(1000, 100000, 20).tolist()))
    cold, warm = float(np.median(colds)), float(np.median(warms))
    return [{"name": "ttft 2000-token shared prefix (median of 5)", "cold_ms": cold * 1e3,
             "cached_ms": warm * 1e3, "speedup": cold / warm,
             "cold_all_ms": [round(c * 1e3, 2) for c in colds],
             "cached_all_ms": [round(w * 1e3, 2) for w in warms]}]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="ttft,p3,fp8")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    rows: list[dict] = []
    if "ttft" in parts:
        rows += ttft_rows()
    if "p3" in parts:
        rows.append(bench("P3 caching on", "qwen3-0.6b", P3_ARGS, args.out))
        rows.append(bench("P3 caching off", "qwen3-0.6b",
                          [*P3_ARGS, "--no-enable-prefix-caching"], args.out))
    if "fp8" in parts:
        common = ["--warmup", "4", "--num-prompts", "32", "--input-len", "4096", "--output-len", "256",
                  "--max-num-seqs", "32", "--max-num-batched-tokens", "8192",
                  "--max-model-len", "4608"]
        rows.append(bench("4k decode bf16 KV", "qwen3-8b", [*common, "--num-blocks", "4800"],
                          args.out))
        rows.append(bench("4k decode fp8 KV", "qwen3-8b",
                          [*common, "--num-blocks", "4800", "--kv-cache-dtype", "fp8"],
                          args.out))
    with open(os.path.join(args.out, "kv_features.json"), "w") as f:
        json.dump(rows, f, indent=2)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
