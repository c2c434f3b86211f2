"""Where a batch-1 decode step's time goes, from its slope over the layer count: the P2
workload (1 x 512 in / 256 out, dummy weights) on copies of a config with fewer decoder
layers. The intercept is what every step pays once (embedding, final norm, lm_head,
sampling, the host's part when it is in the way); the slope is one layer's time.

    python benchmarks/investigations/layer_slope.py --out DIR [--model qwen3-0.6b] [--layers 1,4,14,28]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def config_with_layers(model: str, layers: int, into: str) -> str:
    """A copy of benchmarks/configs/MODEL under ``into`` with ``layers`` decoder layers (0:
    the config's own count); returns its directory."""
    src = os.path.join(BENCH_DIR, "configs", model)
    cfg_dir = os.path.join(into, f"{model}-{layers}L")
    shutil.copytree(src, cfg_dir, dirs_exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if layers:
        cfg["num_hidden_layers"] = layers
    with open(os.path.join(cfg_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg_dir


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--layers", default="1,4,14,28")
    args = p.parse_args()
    sys.path.insert(0, BENCH_DIR)
    from gpu_table import ROWS, bench_command  # benchmarks/gpu_table.py

    os.makedirs(args.out, exist_ok=True)
    rows = []
    configs = tempfile.mkdtemp(prefix="layer_slope-")
    for n in map(int, args.layers.split(",")):
        cfg_dir = config_with_layers(args.model, n, configs)
        json_path = os.path.join(args.out, f"{n}L.json")
        cmd = bench_command(cfg_dir, json_path, ROWS["P2"][1])  # P2's workload
        with open(os.path.join(args.out, f"{n}L.log"), "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not os.path.exists(json_path):
            print(f"{n} layers: rc {rc}", flush=True)
            continue
        with open(json_path) as f:
            r = json.load(f)
        rows.append((n, r["median_itl_ms"], r["decode_throughput_per_request"]))
        print(f"{n} layers: ITL p50 {r['median_itl_ms']:.4f} ms, decode "
              f"{r['decode_throughput_per_request']:.1f} tok/s", flush=True)
    shutil.rmtree(configs, ignore_errors=True)
    if len(rows) >= 2:
        x = np.array([r[0] for r in rows], dtype=float)
        y = np.array([r[1] for r in rows]) * 1000.0
        slope, intercept = np.polyfit(x, y, 1)
        print(f"fit: {intercept:.1f} us per step + {slope:.2f} us per layer")
    print(f"{'layers':>7}{'ITL p50 ms':>12}{'decode tok/s':>14}")
    for n, itl, tps in rows:
        print(f"{n:>7}{itl:>12.4f}{tps:>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
