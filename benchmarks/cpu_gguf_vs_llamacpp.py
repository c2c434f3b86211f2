"""Batch-1 greedy decode on the CPU: vllmpy against llama.cpp on the same GGUF file.

    python benchmarks/cpu_gguf_vs_llamacpp.py --model Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \\
        --llama-python /path/to/venv/bin/python --input-len 128 --output-len 64

llama.cpp runs through llama-cpp-python in an interpreter of its own (``--llama-python``,
a virtual environment that has it), vllmpy in this one; nothing is installed anywhere.
Each side is a child process of this script (this same file, started with ``--child``)
that loads the model once and then runs one measurement per request on its standard
input, so the two alternate (vllmpy, llama.cpp, vllmpy, ...) with the same machine load.
Each side first does ``--warmup`` untimed runs (page-ins of the mapped file, first-call
setup), and each figure is the median over ``--repeats`` runs.

One run: a prompt of ``--input-len`` fixed token ids, then ``--output-len`` tokens
generated greedily with end-of-sequence ignored. The decode rate leaves the prompt out:
(output tokens - 1) / (time from the first generated token to the last). vllmpy reads
those times from its request metrics (prefix caching off, so every run prefills);
llama.cpp's child evaluates the prompt in one ``eval``, takes the argmax of the last
logits, and times the remaining single-token ``eval`` calls. Both use ``--threads``
threads. The greedy tokens of the two are compared, as a check that both ran the model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def prompt_ids(n: int, vocab: int = 20000) -> list[int]:
    """``n`` fixed token ids, spread over the lower ids every vocabulary here has."""
    return [(7919 * i + 1009) % (vocab - 1000) + 1000 for i in range(n)]


# ---- the children -----------------------------------------------------------------------

def child_vllmpy(args: argparse.Namespace) -> None:
    """Load the model in vllmpy, then answer each "run" line with one measurement."""
    import torch

    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype=args.dtype,
              max_model_len=args.input_len + args.output_len + 64,
              enable_prefix_caching=False, max_num_seqs=1)
    _reply({"ready": True, "dtype": str(llm.config.model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()})
    ids = prompt_ids(args.input_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for _ in sys.stdin:
        out = llm.generate([ids], params, use_tqdm=False)[0]
        m, tokens = out.metrics, list(out.outputs[0].token_ids)
        _reply({"prefill_s": m.first_token_time - m.arrival_time,
                "decode_tok_s": (len(tokens) - 1) / (m.last_token_time - m.first_token_time),
                "tokens": tokens})


def child_llama(args: argparse.Namespace) -> None:
    """Load the model in llama-cpp-python, then answer each "run" line likewise."""
    import numpy as np
    from llama_cpp import Llama

    ctx = args.input_len + args.output_len + 64
    llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=ctx, n_batch=min(512, ctx), logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()
    _reply({"ready": True, "threads": args.threads})
    ids = prompt_ids(args.input_len)

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
        return int(logits.argmax())

    for _ in sys.stdin:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tokens = [last_argmax()]
        t1 = time.perf_counter()
        for _ in range(args.output_len - 1):
            llm.eval([tokens[-1]])
            tokens.append(last_argmax())
        t2 = time.perf_counter()
        _reply({"prefill_s": t1 - t0, "decode_tok_s": (len(tokens) - 1) / (t2 - t1),
                "tokens": tokens})


def _reply(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---- the parent -------------------------------------------------------------------------

class Child:
    """One side's process: started with ``--child``, driven one line at a time."""

    def __init__(self, name: str, python: str, args: argparse.Namespace) -> None:
        self.name = name
        # The child's stderr, kept for as long as the child runs.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        cmd = [python, os.path.abspath(__file__), "--child", name, "--model", args.model,
               "--threads", str(args.threads), "--dtype", args.dtype,
               "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"{self.name} child exited:\n{self.log.read()[-3000:]}")
        return json.loads(line)

    def run(self) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def stderr_lines(self, needle: str) -> list[str]:
        self.log.seek(0)
        return [ln.rstrip() for ln in self.log if needle in ln]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--llama-python", help="python of an environment with llama-cpp-python")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per side first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="vllmpy's --dtype")
    p.add_argument("--child", choices=["vllmpy", "llama"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "vllmpy":
        child_vllmpy(args)
        return 0
    if args.child == "llama":
        child_llama(args)
        return 0
    if not args.llama_python:
        p.error("--llama-python is required")

    started = time.perf_counter()
    sides = [Child("vllmpy", sys.executable, args), Child("llama", args.llama_python, args)]
    print(f"loaded both in {time.perf_counter() - started:.0f} s; vllmpy dtype "
          f"{sides[0].info['dtype']}", file=sys.stderr)
    for _ in range(args.warmup):
        for c in sides:
            c.run()
    results: dict[str, list[dict]] = {c.name: [] for c in sides}
    for r in range(args.repeats):
        for c in sides:
            res = c.run()
            results[c.name].append(res)
            print(f"run {r + 1} {c.name}: decode {res['decode_tok_s']:.2f} tok/s, "
                  f"prefill {res['prefill_s']:.2f} s", file=sys.stderr)
    quant_lines = sides[0].stderr_lines("quantized linear weights")
    for c in sides:
        c.close()

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in results[name])

    a, b = results["vllmpy"][-1]["tokens"], results["llama"][-1]["tokens"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    workload = f"{args.input_len} in / {args.output_len} out, batch 1, {args.threads} threads"
    print(f"model: {os.path.basename(args.model)}; vllmpy dtype {sides[0].info['dtype']}")
    for line in quant_lines:
        print(f"vllmpy start-up: {line}")
    print(f"greedy tokens equal for the first {same} of {len(a)}")
    print(f"medians of {args.repeats}, interleaved\n")
    print("| workload | vllmpy tok/s | llama.cpp tok/s | ratio (vllmpy / llama.cpp) |")
    print("|---|---|---|---|")
    dv, dl = med("vllmpy", "decode_tok_s"), med("llama", "decode_tok_s")
    print(f"| decode, {workload} | {dv:.2f} | {dl:.2f} | {dv / dl:.2f} |")
    pv, pl = med("vllmpy", "prefill_s"), med("llama", "prefill_s")
    print(f"| prefill of {args.input_len} tokens (s) | {pv:.2f} s | {pl:.2f} s | "
          f"{pl / pv:.2f} (speed) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
