"""Speculative decoding on the GPU, batch 1, greedy, dummy bf16 weights: rows S3 and S4.

    python benchmarks/spec_gpu.py --out DIR          # both rows; the short table last
    python benchmarks/spec_gpu.py --rates 0.9 --output-len 64

The target is Qwen3-8B's config and the draft Qwen3-0.6B's (benchmarks/configs), both
with random weights, so their tokens agree by chance only, and near-ties of random logits
break differently with the shape of a step: a replayed continuation of the target would
not stay the target's. The acceptance is set at the verify instead: the benchmark's
rejection step runs the real rejection sampler (its cost is paid), then accepts each draft,
in order, with probability ``rate``, and emits the accepted drafts and the target's own
token after them, as a draft model whose per-token agreement with the target is ``rate``
would make it do. Lossless decoding itself is checked by the engine tests
(tests/spec_decode/test_spec_engine.py, also on the GPU).

S3  The cost of a verify step of k = 4 drafts against a one-token decode step: the same
    prompts decoded by the engine without speculation, and by the speculative engine with
    every draft rejected and no draft forwards (each step is then one verify emitting one
    token), compared by their decode rates (tokens after the first over the time from the
    first to the last). The device time of each piece (decode graph, verify graph, the
    verify's logits) and a host profile of both steps are written beside the result.
S4  The speed-up over the engine without speculation at each rate, with the draft model
    run for its k forwards per step (its cost paid), and, for reference, with a free
    proposer (no draft forwards: the ceiling a proposer costing nothing reaches).

The engine without speculation and the speculative one run the same prompts (random token
ids) one at a time; each engine first answers an untimed warm-up request. The greedy
tokens of the speculative engine under the real sampler are compared with the plain
engine's (bf16, random weights: the count is reported, not expected to be all).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "configs", "qwen3-8b")
DRAFT = os.path.join(HERE, "configs", "qwen3-0.6b")


class Acceptance:
    """What the benchmark's rejection step accepts: each draft, in order, with probability
    ``rate`` (None: what the real rejection sampler says); and whether the proposer runs
    the draft model's forwards (``draft``) or proposes for free."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self.draft = True
        self.rng = np.random.default_rng(0)


def install(control: Acceptance) -> None:
    """Have the runner build the benchmark proposer and verify through the benchmark's
    rejection step. The proposer is the configured draft model's; with ``control.draft``
    off it skips the draft's forwards and proposes the request's last token k times. The
    rejection step runs the real rejection sampler (its cost is paid), then, with a
    ``rate``, emits the first ``a`` drafts and the target's own token after them, ``a``
    drawn as the number of leading drafts that pass a coin of probability ``rate``."""
    from vllmpy.spec_decode import draft_model
    from vllmpy.spec_decode import rejection_sampler as rs
    from vllmpy.worker import model_runner

    class BenchProposer(draft_model.DraftModelProposer):
        def propose(self, token_ids, num_tokens, rows, max_drafts):
            if control.draft:  # the draft model's forwards, paid for
                return super().propose(token_ids, num_tokens, rows, max_drafts)
            return [[int(token_ids[r, num_tokens[r] - 1])] * m
                    for r, m in zip(rows, max_drafts)]

    real = rs.rejection_sample

    def rejection_sample(logits, metadata, num_drafts, draft_token_ids, draft_probs=None):
        result = real(logits, metadata, num_drafts, draft_token_ids, draft_probs)
        if control.rate is None:
            return result
        width = max(num_drafts, default=0) + 1
        # source of each emitted token in cat(drafts, the real result's row tokens, [-1])
        sentinel = sum(num_drafts) + logits.shape[0]
        index = np.full((len(num_drafts), width), sentinel, dtype=np.int64)
        emitted = np.empty(len(num_drafts), dtype=np.int64)
        draft_start = row_start = 0
        for i, k in enumerate(num_drafts):
            a = 0
            while a < k and control.rng.random() < control.rate:
                a += 1
            index[i, :a] = draft_start + np.arange(a)
            index[i, a] = sum(num_drafts) + row_start + a
            emitted[i] = a + 1
            draft_start += k
            row_start += k + 1
        device = logits.device
        pool = torch.cat([draft_token_ids, result.row_tokens,
                          torch.full((1,), -1, dtype=torch.int64, device=device)])
        token_ids = pool[rs.to_device(index.reshape(-1), device)].view(len(num_drafts), width)
        return rs.RejectionOutput(token_ids=token_ids,
                                  num_emitted=rs.to_device(emitted, device),
                                  row_tokens=result.row_tokens,
                                  processed_logits=result.processed_logits)

    model_runner.make_proposer = lambda config, runner: BenchProposer(config, runner)
    model_runner.rejection_sample = rejection_sample


def load(args: argparse.Namespace, spec: dict[str, Any] | None) -> Any:
    from vllmpy import LLM

    kwargs: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True,
                                  device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                  num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  # each run computes its whole prompt
                                  enable_prefix_caching=False)
    if spec is not None:
        kwargs["speculative_config"] = spec
    start = time.time()
    llm = LLM(args.target, **kwargs)
    print(f"  loaded in {time.time() - start:.1f} s", flush=True)
    return llm


def decode_rate(out: Any) -> float | None:
    m, n = out.metrics, len(out.outputs[0].token_ids)
    if m is None or m.first_token_time is None or m.last_token_time is None or n < 2:
        return None
    span = m.last_token_time - m.first_token_time
    return (n - 1) / span if span > 0 else None


def run(llm: Any, prompts: list[list[int]], args: argparse.Namespace
        ) -> tuple[float, list[list[int]]]:
    """Mean decode rate over the prompts, one at a time, and their tokens."""
    from vllmpy import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rates, tokens = [], []
    for ids in prompts:
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        rate = decode_rate(out)
        if rate is not None:
            rates.append(rate)
    return statistics.fmean(rates), tokens


def gpu_times(llm: Any, k: int) -> dict[str, float]:
    """The device time (ms, CUDA events) of the target's pieces of a step: the decode
    graph of one request, the mixed graph a verify of k drafts replays, and the logits of
    its k + 1 rows. The buffers hold padding only, so nothing is written to the KV."""
    runner = llm.engine.engine_core.model_runner
    graphs, bufs = runner.graphs, runner.buffers
    tokens = graphs.mixed_size(k + 1)

    def timed(fn, reps: int = 30) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    bufs.stage_padding(1, 1, decode=True)
    decode = timed(lambda: graphs.run(1))
    bufs.stage_padding(tokens, graphs.mixed_seqs(tokens))
    mixed = timed(lambda: graphs.run_mixed(k + 1))
    hidden = graphs.run_mixed(k + 1)
    logits = timed(lambda: runner.model.compute_logits(hidden))
    return {"decode_graph_ms": decode, f"mixed_graph_{tokens}_ms": mixed,
            f"logits_{k + 1}_rows_ms": logits}


def host_profile(llm: Any, prompt: list[int], args: argparse.Namespace, path: str) -> None:
    """cProfile of one request's steps (the host side), by own time, into ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    run(llm, [prompt], args)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(text.getvalue())


def counters(llm: Any) -> tuple[int, int, int]:
    stats = llm.engine.engine_core.scheduler.spec_stats
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def acceptance(before: tuple[int, int, int], after: tuple[int, int, int]
               ) -> tuple[float | None, float | None]:
    drafts, tokens, accepted = (a - b for a, b in zip(after, before))
    return (1 + accepted / drafts if drafts else None,
            accepted / tokens if tokens else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--target", default=TARGET, help="config folder of the target")
    ap.add_argument("--draft", default=DRAFT, help="config folder of the draft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rates", default="0.5,0.7,0.9")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r]
    vocab = json.load(open(os.path.join(args.target, "config.json")))["vocab_size"]
    rng = np.random.default_rng(0)
    high = min(100_000, vocab)
    prompts = [rng.integers(100, high, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    warm = [rng.integers(100, high, args.input_len).tolist()]
    result: dict[str, Any] = {"k": args.k, "input_len": args.input_len,
                              "output_len": args.output_len, "num_prompts": args.num_prompts}

    print("engine without speculation (Qwen3-8B, dummy bf16)", flush=True)
    llm = load(args, None)
    run(llm, warm, args)
    base_rate, base_tokens = run(llm, prompts, args)
    print(f"  decode {base_rate:.1f} tok/s", flush=True)
    if args.device == "cuda":
        result["baseline_gpu"] = gpu_times(llm, args.k)
        print(f"  device times: {result['baseline_gpu']}", flush=True)
        if args.out:
            host_profile(llm, prompts[0], args, os.path.join(args.out, "profile_base.txt"))
    llm.engine.shutdown()
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    result["baseline_tok_s"] = base_rate

    print(f"speculative engine (draft {os.path.basename(args.draft)}, dummy, k={args.k})",
          flush=True)
    control = Acceptance()
    install(control)
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    llm = load(args, spec)
    run(llm, warm, args)
    # every draft as the real sampler judges it: random weights agree by chance only
    before = counters(llm)
    real_rate, spec_tokens = run(llm, prompts, args)
    _, real_acc = acceptance(before, counters(llm))
    same = sum(a == b for a, b in zip(base_tokens, spec_tokens))
    result["real_sampler"] = {"tok_s": real_rate, "draft_acceptance_rate": real_acc,
                              "greedy_identical_prompts": same}
    print(f"  real rejection sampler: {real_rate:.1f} tok/s, draft acceptance "
          f"{real_acc:.3f}; greedy identical to no speculation on {same}/{len(prompts)} "
          f"(bf16)", flush=True)
    # S3: every draft rejected, no draft forwards: each step is a verify of k drafts
    control.rate, control.draft = 0.0, False
    verify_rate, _ = run(llm, prompts, args)
    result["S3"] = {"verify_tok_s": verify_rate, "cost_ratio": base_rate / verify_rate}
    print(f"  S3: every draft rejected: {verify_rate:.1f} tok/s; verify / decode step "
          f"{base_rate / verify_rate:.3f}x", flush=True)
    if args.device == "cuda" and args.out:
        host_profile(llm, prompts[0], args, os.path.join(args.out, "profile_verify.txt"))
    rows = []
    for rate in rates:
        for draft in (True, False):
            control.rate, control.draft = rate, draft
            before = counters(llm)
            tok_s, _ = run(llm, prompts, args)
            mal, acc = acceptance(before, counters(llm))
            mode = "draft" if draft else "free"
            row = {"rate": rate, "mode": mode, "tok_s": tok_s, "speedup": tok_s / base_rate,
                   "mean_acceptance_length": mal, "draft_acceptance_rate": acc}
            rows.append(row)
            if draft and rate == rates[-1] and args.device == "cuda" and args.out:
                host_profile(llm, prompts[0], args, os.path.join(args.out, "profile_draft.txt"))
            print(f"  S4 rate {rate} ({mode}): {tok_s:.1f} tok/s, {tok_s / base_rate:.2f}x, "
                  f"acceptance length {mal:.2f}, draft acceptance {acc:.2f}", flush=True)
    result["S4"] = rows
    llm.engine.shutdown()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "spec_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    print()
    print(f"| row | workload | tok/s | vs no speculation | acceptance length |")
    print(f"|---|---|---|---|---|")
    print(f"| base | {os.path.basename(args.target)} {args.dtype} batch 1, no speculation | "
          f"{base_rate:.1f} | 1.00x | |")
    s3 = result["S3"]
    print(f"| S3 | k={args.k} verify, every draft rejected | {s3['verify_tok_s']:.1f} | "
          f"verify step = {s3['cost_ratio']:.3f}x a decode step | 1.00 |")
    for row in rows:
        what = ("draft model's forwards paid" if row["mode"] == "draft"
                else "free proposer")
        print(f"| S4 | rate {row['rate']}, {what} | {row['tok_s']:.1f} | "
              f"{row['speedup']:.2f}x | {row['mean_acceptance_length']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
