"""Hybrid and latent-attention MoE models on the GPU, dummy bf16 weights: rows H1 and H2,
transformers on the same configs as the peer, the short table last.

    python benchmarks/hybrid_gpu.py --out DIR                  # H1, H2 and the peers
    python benchmarks/hybrid_gpu.py --out DIR --rows H2 --peer ""
    python benchmarks/hybrid_gpu.py --out DIR --tiny           # CPU smoke test, fp32

H1  A Qwen3-Next-80B-A3B-shaped config (hidden 2048, 512 experts top-10 plus a shared
    expert of 512, moe_intermediate 512; Gated DeltaNet layers with 16 key / 32 value heads
    of 128, full attention layers with 16 heads / 2 KV heads / head_dim 256 and an output
    gate; vocab 151,936), the layer count cut from 48 to ``--qwen-layers`` (default 12) so
    that the weights fit one GPU, keeping the real model's pattern of three linear
    attention layers to one full attention layer. ``H1`` is batch-1 decode (512 in / 256
    out), ``H1x64`` 64 requests at once (512 in / 256 out each).
H2  DeepSeek-V2-Lite's config (16B total, 2.4B active: 27 layers of MLA with kv_lora_rank
    512 and no query LoRA, 64 routed experts top-6 plus 2 shared, the first layer dense):
    batch-1 decode (512 in / 256 out). Goal: 70% of its roofline.

Engine rows run through vllm-bench (offline, ``--load-format dummy``), one subprocess per
row so that each row's memory is returned before the next. The peer rows run
transformers' ``generate`` (random weights, use_cache, greedy, batch 1) on the same
config.json in this process, after the engine rows: decode tok/s is
(N - 1) / (t(N tokens) - t(1 token)), so prefill is left out as vllm-bench's decode
throughput per request leaves it out.

Roofline (the physical limit): bytes that must be read per token over the device copy
bandwidth measured in the same run (a large device-to-device copy, bytes read plus bytes
written). At batch 1 these are the active weights: every parameter but the routed experts
and the embedding table, one embedding row, and top_k of the num_experts experts of each
MoE layer (the routers in float32, as the engine keeps them, the rest in the run's dtype).
The recurrent states (read and written each step), the KV / latent cache (at the decode's
mean context, in + out / 2) and the activations are left out of the batch-1 roofline and
written beside it (about 1% of the weight bytes at 512 in / 256 out). For H1x64: one step of 64 decodes reads the non-expert weights once and
the experts any of the 64 tokens picks (expected distinct experts a layer
E * (1 - (1 - k/E)^64), for uniform routing), plus 64 tokens' recurrent states; the
prefill of 64 x 512 tokens is counted at the measured bf16 matrix rate (2 FLOP per
active parameter per token); the roofline is the output tokens over the sum.

Parameter counts are computed from the configs (``param_counts``) and checked against the
transformers model built on the meta device (no memory); a mismatch is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

# ---- configs ----------------------------------------------------------------------------


def qwen3_next_config(layers: int, tiny: bool = False) -> dict[str, Any]:
    """Qwen3-Next-80B-A3B's config.json with ``layers`` layers (3 linear : 1 full)."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "decoder_sparse_step": 1, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [],
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": layers,
        "num_key_value_heads": 2, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936}
    if tiny:
        cfg.update(hidden_size=64, intermediate_size=96, head_dim=16,
                   linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                   num_experts_per_tok=2, vocab_size=256, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    cfg["layer_types"] = ["linear_attention" if (i + 1) % cfg["full_attention_interval"]
                          else "full_attention" for i in range(layers)]
    return cfg


def deepseek_v2_lite_config(layers: int, tiny: bool = False) -> dict[str, Any]:
    """DeepSeek-V2-Lite's config.json (27 layers unless cut)."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1,
        "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
        "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": layers,
        "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "greedy", "torch_dtype": "bfloat16", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 102400}
    if tiny:
        cfg.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
                   n_routed_experts=8, num_experts_per_tok=2, vocab_size=256,
                   max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                   torch_dtype="float32")
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], original_max_position_embeddings=256,
                                   factor=4)
    return cfg


# ---- the roofline arithmetic ------------------------------------------------------------


def param_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters by kind: ``experts`` (all routed experts), ``embed`` (the input table),
    ``router`` (float32 in the engine), ``other`` (everything else), and per MoE layer the
    size of one expert (``one_expert``), the MoE layer count and top_k / num_experts."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    layers = cfg["num_hidden_layers"]
    other = h + (0 if cfg.get("tie_word_embeddings") else v * h)  # final norm, lm_head
    experts = router = moe_layers = 0
    if cfg["architectures"][0] == "Qwen3NextForCausalLM":
        e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        key_dim, value_dim = nk * dk, nv * dv
        conv_dim = 2 * key_dim + value_dim
        heads, kvh, hd = (cfg["num_attention_heads"], cfg["num_key_value_heads"],
                          cfg["head_dim"])
        for i, kind in enumerate(cfg["layer_types"]):
            other += 2 * h  # the two norms
            if kind == "linear_attention":
                other += (h * (2 * key_dim + 2 * value_dim)  # in_proj_qkvz
                          + h * 2 * nv  # in_proj_ba
                          + conv_dim * cfg["linear_conv_kernel_dim"]  # depthwise conv
                          + 2 * nv + dv  # dt_bias, A_log, the gated norm
                          + value_dim * h)  # out_proj
            else:  # q_proj holds the query and its output gate
                other += (h * heads * hd * 2 + 2 * h * kvh * hd + heads * hd * h + 2 * hd)
            sparse = (i not in cfg.get("mlp_only_layers", [])
                      and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0 and e > 0)
            if sparse:
                moe_layers += 1
                experts += e * 3 * mi * h
                router += e * h
                other += 3 * cfg["shared_expert_intermediate_size"] * h + h  # + its gate
            else:
                other += 3 * cfg["intermediate_size"] * h
        top_k, one = cfg["num_experts_per_tok"], 3 * mi * h
    else:  # DeepseekV2ForCausalLM
        e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        heads, nope, rope = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                             cfg["qk_rope_head_dim"])
        lora, vd = cfg["kv_lora_rank"], cfg["v_head_dim"]
        q_lora = cfg.get("q_lora_rank")
        for i in range(layers):
            other += 2 * h
            if q_lora is None:
                other += h * heads * (nope + rope)
            else:
                other += h * q_lora + q_lora + q_lora * heads * (nope + rope)
            other += (h * (lora + rope) + lora  # kv_a_proj_with_mqa, kv_a_layernorm
                      + lora * heads * (nope + vd) + heads * vd * h)  # kv_b_proj, o_proj
            if i >= cfg["first_k_dense_replace"]:
                moe_layers += 1
                experts += e * 3 * mi * h
                router += e * h
                other += 3 * mi * cfg["n_shared_experts"] * h
            else:
                other += 3 * cfg["intermediate_size"] * h
        top_k, one = cfg["num_experts_per_tok"], 3 * mi * h
    return {"embed": v * h, "other": other, "router": router, "experts": experts,
            "one_expert": one, "moe_layers": moe_layers, "num_experts": e, "top_k": top_k,
            "total": v * h + other + router + experts}


def hf_param_count(cfg: dict[str, Any]) -> int | None:
    """transformers' parameter count of the config, built on the meta device."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as d:
            write_config(cfg, d)
            hf_cfg = AutoConfig.from_pretrained(d)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
        return sum(p.numel() for p in model.parameters())
    except Exception as e:  # noqa: BLE001 - the check is reported, not fatal
        print(f"  transformers meta count failed: {e!r}", flush=True)
        return None


def state_bytes_per_token(cfg: dict[str, Any], context: int, state_bytes: int,
                          kv_bytes: int) -> int:
    """Per decode token and sequence: recurrent states read and written (Gated DeltaNet:
    the [nv, dk, dv] state and the conv window), and the KV / latent cache read at
    ``context`` tokens (left out of the roofline; written beside it)."""
    total = 0
    if cfg["architectures"][0] == "Qwen3NextForCausalLM":
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        for kind in cfg["layer_types"]:
            if kind == "linear_attention":
                total += 2 * (nv * dk * dv + conv_dim * (cfg["linear_conv_kernel_dim"] - 1)
                              ) * state_bytes
            else:
                total += context * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * kv_bytes
    else:
        width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        total += cfg["num_hidden_layers"] * context * width * kv_bytes
    return total


def decode_bytes(counts: dict[str, int], dtype_bytes: int, hidden: int,
                 batch: int = 1) -> float:
    """Weight bytes one decode step of ``batch`` tokens reads: the non-expert weights once,
    one embedding row per token, and the distinct experts the tokens pick (expected, for
    uniform routing: E * (1 - (1 - k/E)^batch) a layer)."""
    e, k = counts["num_experts"], counts["top_k"]
    distinct = e * (1 - (1 - k / e) ** batch) if e else 0.0
    return ((counts["other"] + batch * hidden) * dtype_bytes + counts["router"] * 4
            + counts["moe_layers"] * distinct * counts["one_expert"] * dtype_bytes)


def active_params(counts: dict[str, int], hidden: int) -> float:
    """Parameters one token multiplies (for the prefill's FLOP count)."""
    return (counts["other"] + counts["router"] + hidden
            + counts["moe_layers"] * counts["top_k"] * counts["one_expert"])


# ---- the device's two ceilings ----------------------------------------------------------


def _timed(fn, device: str, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy (read plus written), random data, median."""
    n = nbytes // 4
    src = torch.randn(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), device, 20)


def matmul_rate(device: str, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an n x n x n matrix product on random data, median."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device, 20 if device == "cuda" else 3)


# ---- the rows ---------------------------------------------------------------------------


def write_config(cfg: dict[str, Any], path: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def engine_row(row: str, model_dir: str, out_dir: str, args: argparse.Namespace,
               num_prompts: int, input_len: int, output_len: int) -> dict[str, Any]:
    """One vllm-bench run (offline, dummy weights) in a subprocess; its report in
    ``out_dir/<row>.log`` and JSON beside it."""
    json_path = os.path.join(out_dir, f"{row}.json")
    # enough blocks for every request at blocks of 16 tokens or more (the default is 32)
    blocks = num_prompts * -(-(input_len + output_len) // 16) + 64
    cmd = [sys.executable, "-m", "vllmpy.entrypoints.bench", "--model", model_dir,
           "--load-format", "dummy", "--device", args.device, "--dtype", args.dtype,
           "--warmup", str(args.warmup if num_prompts == 1 else min(num_prompts, 8)),
           "--num-prompts", str(num_prompts), "--input-len", str(input_len),
           "--output-len", str(output_len), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max(num_prompts, 1)), "--num-blocks", str(blocks),
           "--output-json", json_path]
    if num_prompts > 1:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += args.engine_args.split()
    start = time.time()
    with open(os.path.join(out_dir, f"{row}.log"), "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                timeout=args.row_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    result: dict[str, Any] = {"row": row, "engine": "vllmpy", "rc": rc,
                              "wall_s": round(time.time() - start, 1)}
    if rc == 0 and os.path.exists(json_path):
        with open(json_path) as f:
            data = json.load(f)
        result.update({k: data[k] for k in ("output_throughput", "total_token_throughput",
                                            "decode_throughput_per_request", "median_itl_ms",
                                            "median_ttft_ms", "duration") if k in data})
    else:
        with open(os.path.join(out_dir, f"{row}.log")) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        result["error"] = lines[-1][:160] if len(lines) > 1 else f"rc {rc}"
    return result


def peer_row(row: str, model_dir: str, args: argparse.Namespace, input_len: int,
             output_len: int) -> dict[str, Any]:
    """transformers generate (random weights, use_cache, greedy) at batch 1."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = None
    try:
        cfg = AutoConfig.from_pretrained(model_dir)
        start = time.time()
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        built = time.time() - start
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(3, cfg.vocab_size, (1, input_len), generator=gen).to(args.device)

        def generate(n: int) -> float:
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                     use_cache=True, pad_token_id=0)
            if args.device == "cuda":
                torch.cuda.synchronize()
            assert out.shape[1] == input_len + n, out.shape
            return time.perf_counter() - t

        generate(min(8, output_len))  # warm-up
        first = generate(1)
        full = generate(output_len)
        decode = (output_len - 1) / (full - first) if full > first else float("nan")
        return {"row": row, "engine": "transformers", "rc": 0, "build_s": round(built, 1),
                "decode_throughput_per_request": decode,
                "output_throughput": output_len / full, "duration": full,
                "ttft_s": first}
    except Exception as e:  # noqa: BLE001 - a failed peer row is reported, not fatal
        traceback.print_exc()
        return {"row": row, "engine": "transformers", "rc": 1, "error": repr(e)[:160]}
    finally:
        model = None  # the weights go before the next row
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for logs and JSON")
    ap.add_argument("--rows", default="H1,H1x64,H2", help="any of H1, H1x64, H2")
    ap.add_argument("--peer", default="H1,H2",
                    help="rows whose config transformers also runs (batch 1); '' for none")
    ap.add_argument("--qwen-layers", type=int, default=12,
                    help="layers of the Qwen3-Next config (a multiple of 4 keeps 3:1)")
    ap.add_argument("--deepseek-layers", type=int, default=27)
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test: tiny shapes, a few tokens, float32 on the CPU")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    ap.add_argument("--input-len", type=int, default=None, help="default 512 (16 tiny)")
    ap.add_argument("--output-len", type=int, default=None, help="default 256 (8 tiny)")
    ap.add_argument("--batch", type=int, default=None, help="H1x64's requests (4 tiny)")
    ap.add_argument("--peer-output-len", type=int, default=None,
                    help="transformers' output tokens (default --output-len)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=None, help="default in + out")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--row-timeout", type=int, default=300, help="seconds per engine row")
    ap.add_argument("--engine-args", default="",
                    help="more vllm-bench flags for every engine row, one string")
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.device = args.device or ("cpu" if tiny else "cuda")
    args.dtype = args.dtype or ("float32" if tiny else "bfloat16")
    in_len = args.input_len or (16 if tiny else 512)
    out_len = args.output_len or (8 if tiny else 256)
    batch = args.batch or (4 if tiny else 64)
    peer_out = args.peer_output_len or out_len
    args.max_model_len = args.max_model_len or in_len + max(out_len, peer_out)
    if tiny and args.qwen_layers == 12:
        args.qwen_layers = 4
    if tiny and args.deepseek_layers == 27:
        args.deepseek_layers = 3
    rows = [r for r in args.rows.split(",") if r]
    peers = [r for r in args.peer.split(",") if r]
    os.makedirs(args.out, exist_ok=True)
    dtype_bytes = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()

    work = tempfile.mkdtemp(prefix="hybrid-configs-")
    configs = {"H1": qwen3_next_config(args.qwen_layers, tiny),
               "H2": deepseek_v2_lite_config(args.deepseek_layers, tiny)}
    dirs = {k: write_config(c, os.path.join(work, k)) for k, c in configs.items()}
    for k, c in configs.items():
        write_config(c, os.path.join(args.out, "configs", k))

    # the two ceilings, measured before any model takes memory
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}", flush=True)
    bw = copy_bandwidth(args.device, (64 if tiny else 4096) << 20)
    mm = matmul_rate(args.device, getattr(torch, args.dtype), 1024 if tiny else 8192)
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + written); {args.dtype} matrix "
          f"rate {mm / 1e12:.2f} TFLOP/s", flush=True)

    limits: dict[str, dict[str, Any]] = {}
    for k, c in configs.items():
        counts = param_counts(c)
        hf = hf_param_count(c)
        h = c["hidden_size"]
        b1 = decode_bytes(counts, dtype_bytes, h)
        state_dtype = dtype_bytes  # --mamba-ssm-cache-dtype auto: the model's dtype
        # at the decode's mean context (in + out / 2)
        side = state_bytes_per_token(c, in_len + out_len // 2, state_dtype, dtype_bytes)
        limits[k] = {"params": counts, "hf_params": hf, "active_params": active_params(
            counts, h), "bytes_per_token_b1": b1, "state_kv_bytes_per_token": side,
            "roofline_b1_tok_s": bw / b1}
        step = decode_bytes(counts, dtype_bytes, h, batch) + batch * side
        prefill_s = 2 * active_params(counts, h) * batch * in_len / mm
        limits[k].update(bytes_per_step_batch=step, prefill_s_batch=prefill_s,
                         roofline_batch_tok_s=batch * out_len / (out_len * step / bw
                                                                 + prefill_s))
        check = ("matches transformers" if hf == counts["total"]
                 else f"transformers counts {hf}")
        print(f"{k}: {c['architectures'][0]}, {c['num_hidden_layers']} layers: "
              f"{counts['total'] / 1e6:,.1f}M parameters ({check}), "
              f"{limits[k]['active_params'] / 1e6:,.1f}M active; batch 1 reads "
              f"{b1 / 1e6:,.1f} MB of weights a token -> roofline "
              f"{limits[k]['roofline_b1_tok_s']:.1f} tok/s (states and cache "
              f"{side / 1e6:.2f} MB a token beside it); {batch} decodes read "
              f"{step / 1e6:,.1f} MB a step", flush=True)

    results: list[dict[str, Any]] = []
    summary = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "dtype": args.dtype, "tiny": tiny, "input_len": in_len, "output_len": out_len,
               "peer_output_len": peer_out, "batch": batch, "copy_bandwidth": bw,
               "matmul_rate": mm, "limits": limits, "rows": results}

    def record(r: dict[str, Any], model: str, n: int, measured: float | None) -> None:
        lim = limits[model]
        roof = lim["roofline_b1_tok_s"] if n == 1 else lim["roofline_batch_tok_s"]
        r.update(model=model, batch=n, roofline_tok_s=roof,
                 share_of_roofline=measured / roof if measured else None)
        results.append(r)
        print(f"  {json.dumps(r)}", flush=True)
        with open(os.path.join(args.out, "hybrid_gpu.json"), "w") as f:  # after every row
            json.dump(summary, f, indent=1)

    # model by model (engine rows, then the peer), so that a run cut short keeps whole models
    plan = {"H1": ("H1", 1), "H1x64": ("H1", batch), "H2": ("H2", 1)}
    for model in ("H1", "H2"):
        for row in (r for r in rows if plan[r][0] == model):
            n = plan[row][1]
            print(f"{row}: vllmpy, {n} request(s) of {in_len} in / {out_len} out", flush=True)
            r = engine_row(row, dirs[model], args.out, args, n, in_len, out_len)
            record(r, model, n, r.get("decode_throughput_per_request") if n == 1
                   else r.get("output_throughput"))
        if model in peers:
            print(f"{model}: transformers, batch 1, {in_len} in / {peer_out} out", flush=True)
            r = peer_row(f"HF {model}", dirs[model], args, in_len, peer_out)
            record(r, model, 1, r.get("decode_throughput_per_request"))

    print()
    print(f"copy {bw / 1e9:.1f} GB/s, {args.dtype} GEMM {mm / 1e12:.2f} TFLOP/s, "
          f"{in_len} in / {out_len} out" + (" (tiny, cpu smoke test)" if tiny else ""))
    print("| row | engine | batch | decode tok/s | output tok/s | ITL p50 ms | roofline tok/s "
          "| share | rc |")
    print("|---|---|---|---|---|---|---|---|---|")
    def num(r: dict[str, Any], key: str, fmt: str = ".1f") -> str:
        v = r.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else ""

    for r in results:
        share = r.get("share_of_roofline")
        status = str(r["rc"]) + (f" {r['error']}" if r.get("error") else "")
        print(f"| {r['row']} | {r['engine']} | {r['batch']} | "
              f"{num(r, 'decode_throughput_per_request')} | {num(r, 'output_throughput')} | "
              f"{num(r, 'median_itl_ms', '.3f')} | {r['roofline_tok_s']:.1f} | "
              f"{f'{share:.0%}' if share else ''} | {status} |")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
