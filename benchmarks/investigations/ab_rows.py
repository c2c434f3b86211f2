"""A/B of GPU table rows under environment settings: each variant runs
``gpu_table.py --rows ROWS --peer ""`` in a fresh process with its variables set, twice
when ``--repeat 2``, and a short table comes last (rows x variants: decode tok/s for P1
and P2, output tok/s for the others).

    python benchmarks/investigations/ab_rows.py --out DIR --rows P2,P1 \
        --variant base: --variant whole:VT_EXP_WHOLE=32768:16:2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="P2,P1")
    p.add_argument("--variant", action="append", required=True,
                   help="NAME:VAR=VALUE,VAR=VALUE (NAME: for no settings)")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    table: dict[str, dict[str, list[float]]] = {}
    for turn in range(args.repeat):
        for spec in args.variant:
            name, _, settings = spec.partition(":")
            env = dict(os.environ)
            for item in filter(None, settings.split(",")):
                key, _, value = item.partition("=")
                env[key] = value
            out = os.path.join(args.out, f"{name}-{turn}")
            proc = subprocess.run([sys.executable, os.path.join(BENCH_DIR, "gpu_table.py"),
                                   "--out", out, "--rows", args.rows, "--peer", ""],
                                  env=env, capture_output=True, text=True)
            with open(os.path.join(args.out, f"{name}-{turn}.log"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            try:
                with open(os.path.join(out, "table.json")) as f:
                    results = json.load(f)
            except OSError:
                results = []
            for r in results:
                # P1 and P2 are measured by the decode rate; the other rows by output tok/s
                table.setdefault(r["row"], {}).setdefault(name, []).append(
                    r.get("decode_throughput_per_request", float("nan"))
                    if r["row"] in ("P1", "P2") else r.get("output_throughput", float("nan")))
            got = ", ".join(f"{r['row']} {r.get('output_throughput', float('nan')):.1f}"
                            f" (decode {r.get('decode_throughput_per_request', float('nan')):.1f})"
                            for r in results)
            print(f"{name} turn {turn}: rc {proc.returncode}: {got}", flush=True)
    names = [spec.partition(":")[0] for spec in args.variant]
    print(f"{'row':<6}" + "".join(f"{n:>22}" for n in names))
    for row, by_name in table.items():
        cells = [", ".join(f"{v:.1f}" for v in by_name.get(n, [])) for n in names]
        print(f"{row:<6}" + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
