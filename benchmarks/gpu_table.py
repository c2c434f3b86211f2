"""The GPU speed table in one run: engine rows through vllm-bench (offline, dummy weights
from the real configs in benchmarks/configs) and transformers on the same config as the peer.

    python benchmarks/gpu_table.py --out DIR [--rows P2,P1,P3]

Each row's full vllm-bench report and JSON land in DIR; the short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"qwen3-0.6b": os.path.join(HERE, "configs", "qwen3-0.6b"),
           "qwen3-8b": os.path.join(HERE, "configs", "qwen3-8b"),
           # a 1B-class Gemma-3 (5 sliding-window layers to 1 global), in Qwen3-0.6B's rows
           "gemma3-1b": os.path.join(HERE, "configs", "gemma3-1b"),
           # Qwen3-30B-A3B's config: 48 layers of 128 experts, 8 active
           "qwen3-30b-a3b": os.path.join(HERE, "configs", "qwen3-30b-a3b"),
           # the same with FP8 block-128 weights, experts included
           "qwen3-30b-a3b-fp8": os.path.join(HERE, "configs", "qwen3-30b-a3b-fp8")}

# row -> (model, vllm-bench arguments)
ROWS = {
    "P2": ("qwen3-0.6b", ["--warmup", "1", "--num-prompts", "1", "--input-len", "512",
                          "--output-len", "256", "--num-blocks", "512"]),
    "P1": ("qwen3-8b", ["--warmup", "1", "--num-prompts", "1", "--input-len", "512",
                        "--output-len", "256", "--num-blocks", "512"]),
    # warm-up requests compile the Triton kernel variants a mixed batch needs before timing
    "P3": ("qwen3-0.6b", ["--warmup", "32", "--num-prompts", "256", "--input-len", "100:1024",
                          "--output-len", "100:1024", "--max-num-seqs", "256",
                          "--max-num-batched-tokens", "8192", "--num-blocks", "16384"]),
    "G2": ("gemma3-1b", ["--warmup", "1", "--num-prompts", "1", "--input-len", "512",
                         "--output-len", "256", "--num-blocks", "512"]),
    "G3": ("gemma3-1b", ["--warmup", "32", "--num-prompts", "256", "--input-len", "100:1024",
                         "--output-len", "100:1024", "--max-num-seqs", "256",
                         "--max-num-batched-tokens", "8192", "--num-blocks", "16384"]),
    "E1": ("qwen3-30b-a3b", ["--warmup", "1", "--num-prompts", "1", "--input-len", "512",
                             "--output-len", "256", "--num-blocks", "512"]),
    "E3": ("qwen3-30b-a3b-fp8", ["--warmup", "1", "--num-prompts", "1", "--input-len", "512",
                                 "--output-len", "256", "--num-blocks", "512"]),
    "E2": ("qwen3-30b-a3b", ["--warmup", "32", "--num-prompts", "256", "--input-len",
                             "100:1024", "--output-len", "100:1024", "--max-num-seqs", "256",
                             "--max-num-batched-tokens", "8192", "--num-blocks", "16384"]),
    "P4": ("qwen3-8b", ["--warmup", "32", "--num-prompts", "1000", "--input-len", "1024",
                        "--output-len", "512", "--max-num-seqs", "256",
                        "--max-num-batched-tokens", "8192", "--num-blocks", "12288"]),
}


def bench_command(model_dir: str, json_path: str, extra: list[str]) -> list[str]:
    """vllm-bench on the GPU with dummy bf16 weights for the config in ``model_dir``."""
    return [sys.executable, "-m", "vllmpy.entrypoints.bench", "--model", model_dir,
            "--load-format", "dummy", "--device", "cuda", "--dtype", "bfloat16",
            "--output-json", json_path, *extra]


def run_row(row: str, out_dir: str) -> dict:
    model, extra = ROWS[row]
    json_path = os.path.join(out_dir, f"{row}.json")
    cmd = bench_command(CONFIGS[model], json_path, extra)
    start = time.time()
    with open(os.path.join(out_dir, f"{row}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    result = {"row": row, "model": model, "rc": proc.returncode,
              "wall_s": round(time.time() - start, 1)}
    if proc.returncode == 0 and os.path.exists(json_path):
        with open(json_path) as f:
            result.update(json.load(f))
    return result


def transformers_decode(model: str, out_dir: str, prompt_len: int = 512,
                        new_tokens: int = 256) -> dict:
    """Peer row: transformers generate() on the same config, random weights, bf16, batch 1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(CONFIGS[model])
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    m.generate(ids, max_new_tokens=8, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.generate(ids, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"row": f"HF {model}", "output_throughput": new_tokens / dt, "duration": dt}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="P2,P1,P3")
    p.add_argument("--peer", default="qwen3-0.6b,qwen3-8b")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    for row in args.rows.split(","):
        results.append(run_row(row, args.out))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    for model in filter(None, args.peer.split(",")):
        try:
            results.append(transformers_decode(model, args.out))
        except Exception as e:  # noqa: BLE001 - a failed peer row is reported, not fatal
            results.append({"row": f"HF {model}", "error": repr(e)})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump(results, f, indent=2)
    # "decode" is vllm-bench's decode throughput per request (after the first token): the
    # batch-1 rows' (P1, P2) measure
    print(f"{'row':<16}{'model':<12}{'out tok/s':>12}{'total tok/s':>13}{'decode':>9}"
          f"{'ITL p50':>9}{'secs':>9}  rc")
    for r in results:
        print(f"{r['row']:<16}{r.get('model', ''):<12}"
              f"{r.get('output_throughput', float('nan')):>12.1f}"
              f"{r.get('total_token_throughput', float('nan')):>13.1f}"
              f"{r.get('decode_throughput_per_request', float('nan')):>9.1f}"
              f"{r.get('median_itl_ms', float('nan')):>9.3f}"
              f"{r.get('duration', float('nan')):>9.2f}  {r.get('rc', r.get('error', ''))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
