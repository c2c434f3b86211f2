"""vllm-cli: a one-shot completion. The completion goes to stdout; everything else to stderr.

    vllm-cli --model model.gguf --prompt "The capital of France is" --max-tokens 16
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from vllmpy.config import EngineArgs
from vllmpy.entrypoints.arg_utils import OneLineArgumentParser

PROG = "vllm-cli"


def make_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG, description="Run a one-shot completion.")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="most tokens to generate (<= 0: up to max_model_len)")
    p.add_argument("--temperature", type=float, default=0.0, help="<= 0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cutoff")
    p.add_argument("--top-k", type=int, default=0, help="0 means all tokens")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for sampling")
    p.add_argument("--stream", action="store_true", help="stream token deltas to stdout")
    p.add_argument("--repeat", type=int, default=None,
                   help="load once, run N completions (streamed with --stream), report "
                        "each run on stderr")
    EngineArgs.add_cli_args(p)
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_strict(argv)
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    return args


@dataclass
class _Run:
    """What one completion reports: its finish reason and token counts."""

    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int  # 0 unless it finished; streamed: the ids as they arrived


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from vllmpy.engine.llm import LLM
    from vllmpy.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            temperature=max(args.temperature, 0.0), top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    runs = args.repeat or 1
    for run in range(1, runs + 1):
        try:
            start_unix, start = time.time(), time.perf_counter()
            run_once = _stream if args.stream else _complete
            done = run_once(llm, args.prompt, params)
            secs = time.perf_counter() - start
            end_unix = time.time()
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 2
        if args.repeat is not None and done is not None:
            _report(run, runs, done, secs, start_unix, end_unix)
    return 0


def _complete(llm: Any, prompt: str, params: Any) -> _Run:
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    sys.stdout.write(completion.text + "\n")
    sys.stdout.flush()
    return _Run(completion.finish_reason, len(out.prompt_token_ids),
                len(completion.token_ids) if out.finished else 0)


def _stream(llm: Any, prompt: str, params: Any) -> _Run | None:
    """Write each delta's text as it comes; count the token ids the deltas carried."""
    out, streamed = None, 0
    for out in llm.generate_stream(prompt, params):
        delta = out.outputs[0]
        streamed += len(delta.token_ids)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if out is None:
        return None
    return _Run(out.outputs[0].finish_reason, len(out.prompt_token_ids),
                streamed if out.finished else 0)


def _report(run: int, runs: int, done: _Run, secs: float, start_unix: float,
            end_unix: float) -> None:
    tok_s = done.completion_tokens / secs if secs > 0 else 0.0
    print(f"{PROG}: run={run}/{runs} finish_reason={done.finish_reason} "
          f"prompt_tokens={done.prompt_tokens} completion_tokens={done.completion_tokens} "
          f"secs={secs:.3f} tok_s={tok_s:.3f}", file=sys.stderr)
    print(f"{PROG}: run={run}/{runs} generate_start_unix={start_unix:.6f} "
          f"generate_end_unix={end_unix:.6f}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
