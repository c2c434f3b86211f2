"""vllm-bench: offline throughput through the engine, or serving latency against a running
vllm-server, reported with ``vllm bench serve``'s metric definitions.

    vllm-bench --model model.gguf --num-prompts 64 --input-len 128:512 --output-len 128
    vllm-bench --base-url http://127.0.0.1:8000 --num-prompts 512 --concurrency 64

Offline mode (no ``--base-url``) builds ``LLM`` from the engine flags and tokenizes every
prompt before timing (``VT_BENCH_PRETOKENIZE=0`` times text prompts instead). Serving mode
streams ``/v1/completions`` and reads the engine's settings from ``GET /server_info``.

Definitions (per successful request): TTFT is the time from sending the request to its
first output chunk (token); E2E is the time to its last; TPOT = (E2E - TTFT) /
(output tokens - 1), over requests with more than one output token; ITL is every gap
between successive output chunks. Throughputs divide totals by the benchmark duration.
The report goes to stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllmpy import envs
from vllmpy.config import EngineArgs, positive_int
from vllmpy.entrypoints.arg_utils import OneLineArgumentParser
from vllmpy.entrypoints.sse_client import HTTPStatusError, stream_events

PROG = "vllm-bench"
LABEL_WIDTH = 43  # report values start in the column after this many characters
# Bytes per stored element, by the dtype names /server_info reports.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


class UsageError(ValueError):
    """A bad flag, value or input file: one line on stderr and exit status 2."""




@dataclass(frozen=True)
class LengthRange:
    """A token length: fixed (``N``) or uniform random in [low, high] (``A:B``)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        parts = text.split(":")
        try:
            low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
        except ValueError:
            low, high = 0, -1
        if len(parts) > 2 or low < 1 or high < low:
            raise argparse.ArgumentTypeError(
                f"expected N or A:B with 1 <= A <= B, got {text!r}")
        return cls(low, high)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text (timed-strings mode, serving) or token ids
    prompt_len: int  # token count, when known before sending (0 otherwise)
    output_len: int


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    error: str = ""


# ---- flags ------------------------------------------------------------------------------

def make_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog=PROG,
                description="Benchmark offline throughput, or a running server's latency.")
    p.add_argument("--dataset-path", default=None,
                   help="JSONL: one object per line with 'prompt' (and optional "
                        "'output_len') or 'prompt_token_ids'; random token ids without it")
    p.add_argument("--num-prompts", type=positive_int, default=100)
    p.add_argument("--input-len", type=LengthRange.parse, default=None,
                   help="random prompt length: N or A:B (uniform); default 1024")
    p.add_argument("--output-len", type=LengthRange.parse, default=None,
                   help="output tokens: N or A:B (uniform); default 128")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="most requests in flight (default: all at once)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="serving mode: Poisson arrivals per second (default inf)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and engine seed")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    p.add_argument("--warmup", type=_non_negative_int, default=None,
                   help="requests run before timing (default 1 offline, 0 serving; serving "
                        "mode runs them at --concurrency)")
    p.add_argument("--output-json", default=None, help="write the full results here")
    p.add_argument("--base-url", default=None,
                   help="serving mode against this server, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    EngineArgs.add_cli_args(p)
    return p


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected requests per second > 0 or inf, "
                                         f"got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_strict(argv)
    if args.dataset_path is not None and not os.path.isfile(args.dataset_path):
        parser.error(f"--dataset-path: no such file: {args.dataset_path}")
    if args.dataset_path is not None and args.input_len is not None:
        parser.error("--input-len applies to random prompts; --dataset-path gives its own")
    if args.base_url is None and args.request_rate != math.inf:
        parser.error("--request-rate applies to serving mode (--base-url)")
    if not args.endpoint.startswith("/"):
        parser.error(f"--endpoint must start with '/', got {args.endpoint!r}")
    args.input_len = args.input_len or LengthRange(1024, 1024)
    args.output_len = args.output_len or LengthRange(128, 128)
    if args.warmup is None:
        args.warmup = 0 if args.base_url else 1
    return args


# ---- prompts ----------------------------------------------------------------------------

def build_requests(args: argparse.Namespace, vocab_size: int, forbidden: set[int],
                   tokenizer: Any | None, as_text: bool) -> list[BenchRequest]:
    """The benchmark's requests, drawn with ``args.seed``. ``as_text``: hand text prompts
    out as text (tokenized by whoever receives them) rather than as token ids."""
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.dataset_path is not None:
        return _dataset_requests(args, rng, tokenizer, as_text)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(forbidden, dtype=np.int64))
    requests = []
    for in_len, out_len in zip(args.input_len.sample(rng, n), args.output_len.sample(rng, n)):
        ids = [int(t) for t in rng.choice(allowed, size=in_len)]
        if as_text and tokenizer is not None:
            requests.append(BenchRequest(tokenizer.decode(ids), 0, out_len))
        else:
            requests.append(BenchRequest(ids, in_len, out_len))
    return requests


def warmup_requests(args: argparse.Namespace, requests: list[BenchRequest],
                    vocab_size: int, forbidden: set[int], tokenizer: Any | None,
                    as_text: bool) -> list[BenchRequest]:
    """``args.warmup`` requests shaped like the timed ones. Random prompts are drawn
    afresh (another seed), so a prefix cache gains nothing from the warm-up; dataset
    prompts are the dataset's first ones."""
    if args.dataset_path is not None:
        return [requests[i % len(requests)] for i in range(args.warmup)]
    warm = argparse.Namespace(**{**vars(args), "seed": args.seed + 1,
                                 "num_prompts": args.warmup})
    return build_requests(warm, vocab_size, forbidden, tokenizer, as_text)


def _dataset_requests(args: argparse.Namespace, rng: np.random.Generator,
                      tokenizer: Any | None, as_text: bool) -> list[BenchRequest]:
    entries = args.dataset
    if len(entries) < args.num_prompts:
        print(f"{PROG}: {args.dataset_path} holds {len(entries)} prompts; using them all",
              file=sys.stderr)
    default_lens = args.output_len.sample(rng, len(entries))
    requests = []
    for (line_no, entry), out_len in zip(entries, default_lens):
        out_len = entry.get("output_len") or out_len
        if "prompt_token_ids" in entry:
            ids = entry["prompt_token_ids"]
            requests.append(BenchRequest(ids, len(ids), out_len))
        elif as_text:
            requests.append(BenchRequest(entry["prompt"], 0, out_len))
        elif tokenizer is None:
            raise UsageError(f"--dataset-path line {line_no} has a text prompt but the model "
                             "has no tokenizer; give prompt_token_ids")
        else:
            ids = tokenizer.encode(entry["prompt"], add_special_tokens=True)
            requests.append(BenchRequest(ids, len(ids), out_len))
    return requests


def read_dataset(path: str, limit: int) -> list[tuple[int, dict[str, Any]]]:
    """The first ``limit`` objects of a JSONL file, with their line numbers."""
    entries: list[tuple[int, dict[str, Any]]] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(entries) == limit:
                break
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--dataset-path line {line_no} is not JSON: {e}") from None
            entries.append((line_no, _check_entry(entry, line_no)))
    if not entries:
        raise UsageError(f"--dataset-path {path} holds no prompts")
    return entries


def _check_entry(entry: Any, line_no: int) -> dict[str, Any]:
    where = f"--dataset-path line {line_no}"
    if not isinstance(entry, dict):
        raise UsageError(f"{where} is not a JSON object")
    ids, text, out_len = (entry.get("prompt_token_ids"), entry.get("prompt"),
                          entry.get("output_len"))
    if ids is not None:
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and t >= 0 for t in ids)):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of ids")
    elif not isinstance(text, str) or not text:
        raise UsageError(f"{where} has neither a 'prompt' string nor 'prompt_token_ids'")
    if out_len is not None and (not isinstance(out_len, int) or out_len < 1):
        raise UsageError(f"{where}: output_len must be a positive integer")
    return entry


def check_lengths(requests: list[BenchRequest], tokenizer: Any | None,
                  max_model_len: int) -> None:
    """Refuse, before timing, a request the engine would cut short."""
    for i, req in enumerate(requests):
        n_in = req.prompt_len or len(tokenizer.encode(req.prompt))  # type: ignore[union-attr]
        if n_in + req.output_len > max_model_len:
            raise UsageError(f"prompt {i} needs {n_in + req.output_len} tokens ({n_in} in + "
                             f"{req.output_len} out) but max_model_len is {max_model_len}; "
                             "shorten --input-len/--output-len or raise --max-model-len")


# ---- offline mode -----------------------------------------------------------------------

def run_offline(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult], float]:
    from vllmpy.engine.llm import LLM

    pretokenize = envs.VT_BENCH_PRETOKENIZE
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    cfg, tokenizer = llm.config, llm.get_tokenizer()
    if not pretokenize and tokenizer is None:
        raise UsageError("VT_BENCH_PRETOKENIZE=0 times text prompts, but this model has no "
                         "tokenizer")
    forbidden = set(cfg.model.eos_token_ids) | set(getattr(tokenizer, "all_special_ids", []))
    vocab = cfg.model.text_config.vocab_size
    if tokenizer is not None:
        vocab = min(vocab, tokenizer.vocab_size)
    requests = build_requests(args, vocab, forbidden, tokenizer, as_text=not pretokenize)
    if cfg.model.runner == "pooling":
        return run_offline_embed(args, llm, requests, vocab, forbidden, tokenizer)
    check_lengths(requests, tokenizer, cfg.model.max_model_len)
    header = engine_header(llm, "offline pretokenized" if pretokenize
                           else "offline timed-strings")
    params = [_sampling_params(r.output_len, args.ignore_eos) for r in requests]
    if args.warmup:
        print(f"{PROG}: warmup: {args.warmup} request(s)", file=sys.stderr)
        warm = warmup_requests(args, requests, vocab, forbidden, tokenizer,
                               as_text=not pretokenize)
        llm.generate([r.prompt for r in warm],
                     [_sampling_params(r.output_len, args.ignore_eos) for r in warm],
                     use_tqdm=False)
    print(f"{PROG}: running {len(requests)} requests "
          f"(concurrency {args.concurrency or 'all'})", file=sys.stderr)
    before = llm.engine.engine_core.get_stats().spec_decoding
    start = time.perf_counter()
    if args.concurrency is None or args.concurrency >= len(requests):
        results = _offline_all_at_once(llm, requests, params)
    else:
        results = _offline_bounded(llm, requests, params, args.concurrency)
    duration = time.perf_counter() - start
    after = llm.engine.engine_core.get_stats().spec_decoding
    if after is not None:
        assert before is not None
        header["spec_decode"] = spec_decode_summary(
            {"drafts": before.num_drafts, "draft_tokens": before.num_draft_tokens,
             "accepted": before.num_accepted_tokens},
            {"drafts": after.num_drafts, "draft_tokens": after.num_draft_tokens,
             "accepted": after.num_accepted_tokens})
    return header, results, duration


def run_offline_embed(args: argparse.Namespace, llm: Any, requests: list[BenchRequest],
                      vocab: int, forbidden: set[int], tokenizer: Any | None
                      ) -> tuple[dict[str, Any], list[RequestResult], float]:
    """A pooling model: every prompt embedded (``--output-len`` does not apply); each
    result is one prompt, its output one vector."""
    for r in requests:
        if r.prompt_len > llm.config.model.max_model_len:
            raise UsageError(f"--input-len {r.prompt_len} exceeds the model's maximum input "
                             f"length of {llm.config.model.max_model_len} tokens")
    header = engine_header(llm, "offline embeddings")
    if args.warmup:
        warm = warmup_requests(args, requests, vocab, forbidden, tokenizer, as_text=False)
        llm.embed([r.prompt for r in warm], use_tqdm=False)
    print(f"{PROG}: embedding {len(requests)} prompts", file=sys.stderr)
    start = time.perf_counter()
    outs = llm.embed([r.prompt for r in requests], use_tqdm=False)
    duration = time.perf_counter() - start
    results = [RequestResult(success=True, prompt_len=len(o.prompt_token_ids),
                             ttft=duration, e2e=duration) for o in outs]
    header["embeddings"] = {"sentences_per_s": len(outs) / duration,
                            "input_tokens_per_s": sum(len(o.prompt_token_ids) for o in outs)
                            / duration,
                            "dimensions": len(outs[0].outputs.embedding) if outs else 0}
    return header, results, duration


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                 "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


def spec_decode_summary(before: dict[str, float], after: dict[str, float]
                        ) -> dict[str, Any] | None:
    """Speculative decoding over the timed run, from the engine's totals before and after
    it: drafts, draft tokens, accepted tokens, the mean acceptance length (1 + accepted
    per draft, vLLM's figure) and the draft acceptance rate; None when nothing drafted."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    if delta.get("drafts", 0) <= 0:
        return None
    return {"num_drafts": int(delta["drafts"]), "num_draft_tokens": int(delta["draft_tokens"]),
            "num_accepted_tokens": int(delta["accepted"]),
            "mean_acceptance_length": 1 + delta["accepted"] / delta["drafts"],
            "draft_acceptance_rate": delta["accepted"] / max(delta["draft_tokens"], 1)}


def scrape_spec_counters(base: str) -> dict[str, float] | None:
    """The server's speculative-decoding totals from ``GET /metrics``; None when it
    exports none (speculation off) or the page cannot be read."""
    import httpx

    try:
        reply = httpx.get(f"{base}/metrics", timeout=30)
        reply.raise_for_status()
    except httpx.HTTPError:
        return None
    totals: dict[str, float] = {}
    for line in reply.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] = totals.get(SPEC_COUNTERS[name], 0.0) + float(
                line.rsplit(" ", 1)[1])
    return totals if len(totals) == len(SPEC_COUNTERS) else None


def _sampling_params(output_len: int, ignore_eos: bool) -> Any:
    from vllmpy.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=ignore_eos)


def _offline_all_at_once(llm: Any, requests: list[BenchRequest],
                         params: list[Any]) -> list[RequestResult]:
    sent = time.time()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    return [_offline_result(out, sent) for out in outputs]


def _offline_bounded(llm: Any, requests: list[BenchRequest], params: list[Any],
                     concurrency: int) -> list[RequestResult]:
    """At most ``concurrency`` requests in flight; a new one starts as each finishes."""
    from vllmpy.sampling_params import RequestOutputKind

    pending = deque(range(len(requests)))
    in_flight: dict[str, tuple[int, float]] = {}  # request id -> (index, time sent)
    results: list[RequestResult] = [RequestResult(False, error="not run")] * len(requests)
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.popleft()
            final = params[i].clone()
            final.output_kind = RequestOutputKind.FINAL_ONLY
            sent = time.time()
            in_flight[llm.add_request(requests[i].prompt, final)] = (i, sent)
        for out in llm.step():
            if out.finished:
                i, sent = in_flight.pop(out.request_id)
                results[i] = _offline_result(out, sent)
    return results


def _offline_result(out: Any, sent: float) -> RequestResult:
    m = out.metrics
    n_out = len(out.outputs[0].token_ids)
    if m is None or m.first_token_time is None or m.finished_time is None:
        return RequestResult(False, len(out.prompt_token_ids), n_out, error="no timing")
    return RequestResult(True, len(out.prompt_token_ids), n_out, m.first_token_time - sent,
                         m.finished_time - sent, list(m.inter_token_latencies))


def engine_header(llm: Any, mode: str) -> dict[str, Any]:
    cfg = llm.config
    device = cfg.device
    if device == "cuda":
        import torch

        device = f"cuda ({torch.cuda.get_device_name()})"
    from vllmpy.engine.configure import kv_cache_dtype_name

    kv = cfg.cache.kv_cache_dtype
    return {"model": llm.source.display_name, "device": device,
            "dtype": str(cfg.model.dtype).removeprefix("torch."),
            "max_model_len": cfg.model.max_model_len, "block_size": cfg.cache.block_size,
            "num_blocks": cfg.cache.num_blocks, "max_num_seqs": cfg.scheduler.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens, "mode": mode,
            "kv_cache_dtype_requested": cfg.cache.kv_cache_dtype_requested,
            "kv_cache_dtype": kv_cache_dtype_name(kv), "kv_bytes": kv.itemsize}


# ---- serving mode -----------------------------------------------------------------------

def run_serving(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult], float]:
    import asyncio

    try:
        import httpx
    except ImportError:
        raise UsageError("serving mode needs the httpx package (pip install httpx)") from None
    base = args.base_url.rstrip("/")
    try:
        info = httpx.get(f"{base}/server_info", timeout=30)
        info.raise_for_status()
        config = info.json()["vllm_config"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise UsageError(f"--base-url {args.base_url}: GET /server_info failed: {e}") from None
    vocab = _serving_vocab(args, config)
    requests = build_requests(args, *vocab, tokenizer=None, as_text=True)
    warm = warmup_requests(args, requests, *vocab, tokenizer=None, as_text=True)
    header = serving_header(config)
    results, duration, spec = asyncio.run(_serve_all(args, base, config, requests, warm))
    header["spec_decode"] = spec
    return header, results, duration


def _serving_vocab(args: argparse.Namespace, config: dict[str, Any]) -> tuple[int, set[int]]:
    """Vocabulary size and ids to avoid for random prompts, read from the model's config
    (``--model``, or the path the server names) on this machine."""
    if args.dataset_path is not None:
        return 0, set()
    from vllmpy.loader.source import resolve_model_source

    for path in (args.model, config.get("model")):
        if path and os.path.exists(path):
            fmt = "dummy" if config.get("source") == "dummy" else args.load_format
            src = resolve_model_source(path, load_format=fmt)
            from vllmpy.models.registry import text_config

            return text_config(src.hf_config).vocab_size, set(src.eos_token_ids)
    raise UsageError("random prompts in serving mode need the model's vocabulary: pass "
                     "--model <model dir or .gguf> as served, or --dataset-path")


def serving_header(config: dict[str, Any]) -> dict[str, Any]:
    kv = str(config.get("kv_cache_dtype", "unknown"))
    return {"model": config.get("served_model_name") or config.get("model"),
            "device": config.get("device"), "dtype": config.get("dtype"),
            "max_model_len": config.get("max_model_len"),
            "block_size": config.get("block_size"), "num_blocks": config.get("num_blocks"),
            "max_num_seqs": config.get("max_num_seqs"),
            "max_num_batched_tokens": config.get("max_num_batched_tokens"),
            "mode": "serving",
            "kv_cache_dtype_requested": config.get("kv_cache_dtype_requested",
                                                   "not reported by the server"),
            "kv_cache_dtype": kv, "kv_bytes": DTYPE_BYTES.get(kv)}


async def _serve_all(args: argparse.Namespace, base: str, config: dict[str, Any],
                     requests: list[BenchRequest], warm: list[BenchRequest]
                     ) -> tuple[list[RequestResult], float, dict[str, Any] | None]:
    import asyncio

    url = f"{base}{args.endpoint}"
    model = str(config.get("served_model_name") or config.get("model"))
    limit = asyncio.Semaphore(args.concurrency or len(requests))
    rng = np.random.default_rng(args.seed)

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:
            return await stream_completion(url, model, req, args.ignore_eos)

    # warm-up at the timed concurrency, so its batches (and kernels) look alike
    await asyncio.gather(*(one(req) for req in warm))
    print(f"{PROG}: sending {len(requests)} requests (concurrency "
          f"{args.concurrency or 'all'}, rate {args.request_rate}/s)", file=sys.stderr)
    before = scrape_spec_counters(base)
    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.create_task(one(req)))
        if args.request_rate != math.inf:
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    after = scrape_spec_counters(base) if before is not None else None
    spec = None if after is None or before is None else spec_decode_summary(before, after)
    return list(results), duration, spec


async def stream_completion(url: str, model: str, req: BenchRequest,
                            ignore_eos: bool) -> RequestResult:
    """One streaming completion; a failure is returned as a failed result, never raised."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(False, prompt_len=req.prompt_len)
    chunks = 0
    sent = last = time.perf_counter()
    try:
        async for data in stream_events(url, json.dumps(body).encode()):
            if data == b"[DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message", chunk["error"]))
                return result
            if chunk.get("choices"):
                chunks += 1
                if chunks == 1:
                    result.ttft = now - sent
                else:
                    result.itl.append(now - last)
                last = now
            elif chunk.get("usage"):
                result.output_tokens = int(chunk["usage"]["completion_tokens"])
                result.prompt_len = int(chunk["usage"]["prompt_tokens"])
    except HTTPStatusError as e:
        result.error = str(e)
        return result
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not raised
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = last - sent
    result.output_tokens = result.output_tokens or chunks
    result.success = chunks > 0
    result.error = "" if chunks else "the stream carried no tokens"
    return result


# ---- metrics and the report -------------------------------------------------------------

def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's ``vllm bench serve`` metrics (times in ms), over the successful requests."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    decoding = [r for r in ok if r.output_tokens > 1]
    decode_time = sum(r.e2e - r.ttft for r in decoding)
    summary: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "decode_throughput_per_request": (sum(r.output_tokens - 1 for r in decoding)
                                          / decode_time if decode_time > 0 else 0.0),
    }
    series = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in decoding],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}
    for name, values in series.items():
        ms = np.array(values or [0.0]) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        for p in (90, 99):
            summary[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<{LABEL_WIDTH - 1}} {value}"


def format_report(header: dict[str, Any], summary: dict[str, Any]) -> str:
    kv_bytes = header["kv_bytes"]
    pages = f" ({kv_bytes}-byte pages)" if kv_bytes else ""
    lines = [f"{' vllm-bench ':=^50}",
             _line("Model:", header["model"]), _line("Mode:", header["mode"]),
             _line("Device:", header["device"]), _line("Dtype:", header["dtype"]),
             _line("Max model len:", header["max_model_len"]),
             _line("Block size:", header["block_size"]),
             _line("Block count:", header["num_blocks"]),
             _line("Max num seqs:", header["max_num_seqs"]),
             _line("Max num batched tokens:", header["max_num_batched_tokens"]),
             _line("KV cache dtype (requested):", header["kv_cache_dtype_requested"]),
             _line("KV cache dtype (resolved storage):", f"{header['kv_cache_dtype']}{pages}"),
             f"{' Benchmark Result ':=^50}",
             _line("Successful requests:", summary["completed"]),
             _line("Failed requests:", summary["failed"]),
             _line("Benchmark duration (s):", summary["duration"]),
             _line("Total input tokens:", summary["total_input_tokens"]),
             _line("Total generated tokens:", summary["total_output_tokens"]),
             _line("Request throughput (req/s):", summary["request_throughput"]),
             _line("Output token throughput (tok/s):", summary["output_throughput"]),
             _line("Total token throughput (tok/s):", summary["total_token_throughput"]),
             _line("Decode throughput per request (tok/s):",
                   summary["decode_throughput_per_request"])]
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"),
                              ("e2el", "End-to-end Latency", "E2E")):
        lines.append(f"{title:-^50}")
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"),
                           ("p99", "P99")):
            lines.append(_line(f"{name} {short} (ms):", summary[f"{stat}_{key}_ms"]))
    embed = header.get("embeddings")
    if embed is not None:
        lines += [f"{'Embeddings':-^50}",
                  _line("Embedding throughput (sentences/s):", embed["sentences_per_s"]),
                  _line("Input token throughput (tok/s):", embed["input_tokens_per_s"]),
                  _line("Embedding dimensions:", embed["dimensions"])]
    spec = header.get("spec_decode")
    if spec is not None:
        lines += [f"{'Speculative Decoding':-^50}",
                  _line("Mean acceptance length:", spec["mean_acceptance_length"]),
                  _line("Draft acceptance rate (%):", 100 * spec["draft_acceptance_rate"]),
                  _line("Drafts:", spec["num_drafts"]),
                  _line("Draft tokens:", spec["num_draft_tokens"]),
                  _line("Accepted tokens:", spec["num_accepted_tokens"])]
    lines.append("=" * 50)
    return "\n".join(lines)


def write_json(path: str, args: argparse.Namespace, header: dict[str, Any],
               summary: dict[str, Any], results: list[RequestResult]) -> None:
    ok = [r for r in results if r.success]
    data = {"config": header,
            "args": {k: (str(v) if isinstance(v, LengthRange) else v)
                     for k, v in vars(args).items() if k != "dataset" and v != math.inf},
            **summary,
            "input_lens": [r.prompt_len for r in ok], "output_lens": [r.output_tokens for r in ok],
            "ttfts": [r.ttft for r in ok], "e2els": [r.e2e for r in ok],
            "itls": [r.itl for r in ok], "errors": [r.error for r in results if not r.success],
            "requests": [asdict(r) for r in results]}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.dataset_path is not None:  # read before the engine starts
            args.dataset = read_dataset(args.dataset_path, args.num_prompts)
        run = run_serving if args.base_url else run_offline
        header, results, duration = run(args)
    except ValueError as e:  # UsageError, and the engine's refusals of its flags
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    summary = summarize(results, duration)
    print(format_report(header, summary), flush=True)
    for err in sorted({r.error for r in results if not r.success})[:5]:
        print(f"{PROG}: failed request: {err}", file=sys.stderr)
    if args.output_json:
        write_json(args.output_json, args, header, summary, results)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
