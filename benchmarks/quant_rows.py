"""The quantized-weight speed rows on one GPU, a short table last.

    python benchmarks/quant_rows.py --out DIR [--rows Q1,Q2,Q4,Q3] [--gguf FILE]
                                    [--llama-bench BUILD/bin/llama-bench]
    python benchmarks/quant_rows.py --write-gguf FILE   # only write Q1's file

Q1: batch-1 decode (512 in / 256 out) of a Qwen3-8B-shaped GGUF in the Q4_K_M mix (q, k, o,
gate, up and the embedding Q4_K; v, down and the output head Q6_K), kept in its blocks.
Without ``--gguf`` the file is written here with random blocks (sane fp16 scales), which
reads the same bytes per token as a real one. Q2 / Q4: the same workload on the
Qwen3-8B config with dummy weights quantized at load by the FP8 block-128 method and by
the GPTQ 4-bit group-128 method (``benchmarks/configs``). Q3: the P4 workload
(1,000 x 1,024 in / 512 out) through the FP8 method. P1 / P4: Q2's and Q3's workloads in
bf16, their baselines in the same run. The roofline column is the weight
bytes read per token at ``--bandwidth`` (GB/s, the device's measured copy rate).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_table import bench_command  # noqa: E402

DECODE = ["--warmup", "1", "--num-prompts", "1", "--input-len", "512", "--output-len", "256",
          "--num-blocks", "512"]
P4 = ["--warmup", "32", "--num-prompts", "1000", "--input-len", "1024", "--output-len", "512",
      "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--num-blocks", "12288"]
ROWS = {"Q2": ("qwen3-8b-fp8", DECODE), "Q4": ("qwen3-8b-w4a16", DECODE),
        "Q3": ("qwen3-8b-fp8", P4), "P1": ("qwen3-8b", DECODE), "P4": ("qwen3-8b", P4)}

# Qwen3-8B
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 12288, 36, 32, 8, 128, 151936


def write_q4_k_m_gguf(path: str) -> int:
    """A Qwen3-8B-shaped GGUF with random Q4_K / Q6_K blocks; returns its weight bytes."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_vocab_size(VOCAB)
    # no tokenizer: llama.cpp then loads the file with dummy tokens (its vocab type "none")
    writer.add_tokenizer_model("none")
    q = gguf.GGMLQuantizationType
    total = 0

    def matrix(name: str, rows: int, cols: int, qtype) -> None:
        nonlocal total
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
        scale = np.array([0.0005], np.float16).view(np.uint8)
        if qtype == q.Q4_K:  # d and dmin lead the block
            raw[..., 0:2] = scale
            raw[..., 2:4] = scale
        else:  # Q6_K: d is the block's last two bytes
            raw[..., -2:] = scale
        raw = raw.reshape(rows, -1)
        total += raw.nbytes
        writer.add_tensor(name, raw, raw_shape=(rows, raw.shape[1]), raw_dtype=qtype)

    matrix("token_embd.weight", VOCAB, HIDDEN, q.Q4_K)
    matrix("output.weight", VOCAB, HIDDEN, q.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        for part in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{part}.weight", np.ones(HIDDEN, np.float32))
        for part in ("attn_q_norm", "attn_k_norm"):
            writer.add_tensor(f"blk.{i}.{part}.weight", np.ones(HEAD_DIM, np.float32))
        matrix(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, HIDDEN, q.Q4_K)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, q.Q4_K)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN, q.Q6_K)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM, q.Q4_K)
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, q.Q4_K)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, q.Q4_K)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return total


def gguf_decode(path: str, prompt_len: int = 512, new_tokens: int = 256) -> dict:
    """Batch-1 decode tok/s of a GGUF through the engine (CUDA graphs, bf16 activations):
    (new_tokens - 1) / (time of the whole request - time to its first token)."""
    import torch

    from vllmpy import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              num_blocks=512)
    prompt = torch.randint(0, 50_000, (prompt_len,), generator=torch.Generator()
                           .manual_seed(0)).tolist()
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], full, use_tqdm=False)  # warm-up
    times = {}
    for name, params in (("first", first), ("full", full)):
        best = float("inf")
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        times[name] = best
    decode = (new_tokens - 1) / (times["full"] - times["first"])
    return {"row": "Q1", "decode_tok_s": decode, "ttft_s": times["first"]}


def gguf_weight_bytes(path: str) -> int:
    """The bytes of a GGUF's tensors, as stored."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def llama_bench(binary: str, path: str, prompt_len: int = 512, new_tokens: int = 256) -> dict:
    """llama.cpp's ``llama-bench`` on the same file, all layers on the GPU, with and without
    flash attention: its mean tg tok/s for each."""
    import subprocess

    cmd = [binary, "-m", path, "-p", str(prompt_len), "-n", str(new_tokens), "-ngl", "99",
           "-fa", "0,1", "-r", "3", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"llamacpp_error": done.stderr[-2000:]}
    out = {}
    for entry in json.loads(done.stdout):
        if entry.get("n_gen", 0) == new_tokens and entry.get("n_prompt", 0) == 0:
            fa = "fa1" if entry.get("flash_attn") in (1, True, "1", "on") else "fa0"
            out[f"llamacpp_tg_{fa}"] = entry["avg_ts"]
        elif entry.get("n_prompt", 0) == prompt_len and entry.get("n_gen", 0) == 0:
            fa = "fa1" if entry.get("flash_attn") in (1, True, "1", "on") else "fa0"
            out[f"llamacpp_pp_{fa}"] = entry["avg_ts"]
    out["llamacpp_build"] = next((e.get("build_commit") for e in json.loads(done.stdout)), None)
    return out


def main() -> int:
    import subprocess

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=False)
    p.add_argument("--rows", default="Q1,Q2,Q4,Q3")
    p.add_argument("--gguf", default=None, help="a Qwen3-8B Q4_K_M GGUF (else written)")
    p.add_argument("--write-gguf", default=None, metavar="PATH",
                   help="only write the random Q4_K_M GGUF to PATH and exit")
    p.add_argument("--llama-bench", default=None, metavar="BIN",
                   help="llama.cpp's llama-bench: Q1's peer on the same file")
    p.add_argument("--bandwidth", type=float, default=4270.0, help="copy GB/s")
    args = p.parse_args()
    if args.write_gguf:
        print(f"wrote {write_q4_k_m_gguf(args.write_gguf)} weight bytes to {args.write_gguf}")
        return 0
    if not args.out:
        p.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for row in args.rows.split(","):
        if row == "Q1":
            path = args.gguf or os.path.join(args.out, "qwen3-8b-q4_k_m-random.gguf")
            weight_bytes = gguf_weight_bytes(path) if args.gguf else write_q4_k_m_gguf(path)
            r = gguf_decode(path)
            # per token: every matrix but the embedding (one row of it is read)
            per_token = weight_bytes - VOCAB * HIDDEN * 144 // 256
            r["roofline_tok_s"] = args.bandwidth * 1e9 / per_token
            if args.llama_bench:
                r.update(llama_bench(args.llama_bench, path))
                if r.get("llamacpp_tg_fa1"):
                    r["ratio_vs_llamacpp_fa1"] = r["decode_tok_s"] / r["llamacpp_tg_fa1"]
            if args.gguf is None:
                os.remove(path)
            results.append(r)
            continue
        config, extra = ROWS[row]
        json_path = os.path.join(args.out, f"{row}.json")
        cmd = bench_command(os.path.join(HERE, "configs", config), json_path, extra)
        with open(os.path.join(args.out, f"{row}.log"), "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        r = {"row": row, "rc": rc}
        if rc == 0:
            with open(json_path) as f:
                data = json.load(f)
            r.update({k: data.get(k) for k in ("output_throughput", "total_token_throughput",
                                               "decode_throughput_per_request", "median_itl_ms")})
        results.append(r)
    with open(os.path.join(args.out, "quant_rows.json"), "w") as f:
        json.dump(results, f, indent=1)
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
