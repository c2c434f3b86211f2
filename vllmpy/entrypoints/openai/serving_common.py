"""What the completion and chat handlers share: request parsing, prompt checks, the
merged multi-request stream, SSE framing with keepalives, and client-disconnect races."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pydantic
from starlette.requests import Request

from vllmpy import envs
from vllmpy.engine.async_llm import AsyncLLM, EngineDeadError, EngineGenerateError
from vllmpy.entrypoints.openai.errors import OpenAIError, validation_error_to_openai
from vllmpy.entrypoints.openai.multimodal_limits import MultimodalLimits
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    PromptLogprobsJSON,
    PromptTokenUsageInfo,
    UsageInfo,
    ignored_fields,
)
from vllmpy.outputs import Logprob, PromptLogprobs, RequestOutput
from vllmpy.sampling_params import SamplingParams

M = TypeVar("M", bound=pydantic.BaseModel)
T = TypeVar("T")


@dataclass
class ServerContext:
    """What every handler needs to know about the running server."""

    engine: AsyncLLM
    served_model_name: str
    max_model_len: int
    force_include_usage: bool
    default_chat_template_kwargs: dict[str, Any]
    log_requests: bool
    log_outputs: bool
    max_log_len: int
    tool_parser: str | None = None  # the resolved --tool-call-parser; None: off
    reasoning_parser: str | None = None  # the resolved --reasoning-parser; None: off
    # --limit-mm-per-prompt / --language-model-only: what a multimodal part is refused with
    mm_limits: MultimodalLimits = field(default_factory=MultimodalLimits)

    def check_model(self, model: str | None) -> None:
        """An unknown model name is a 404 NotFoundError, as OpenAI and vLLM answer."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                              f"`{self.served_model_name}`", param="model")

    def stream_usage(self, options: Any) -> tuple[bool, bool]:
        """(send a final usage chunk, put usage in every chunk) for a stream request."""
        include = self.force_include_usage or bool(options and options.include_usage)
        return include, include and bool(options and options.continuous_usage_stats)

    def clip(self, text: str) -> str:
        """A prompt or output as logged: its repr, cut to --max-log-len characters (the
        line around it is whole)."""
        if len(text) <= self.max_log_len:
            return repr(text)
        return f"{text[:self.max_log_len]!r}... (cut to {self.max_log_len} characters)"

    def log(self, request_id: str, what: str) -> None:
        print(f"server: {request_id}: {what}", file=sys.stderr, flush=True)


async def read_body(raw: Request) -> bytes:
    """The request body, refused with a 413 once it passes the server's limit (also for a
    chunked body, which announces no length); read once, then cached."""
    cached = getattr(raw, "_body", None)
    if cached is not None:
        return cached
    limit = getattr(raw.app.state, "max_body_bytes", None)
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw._body = b"".join(chunks)  # what Request.body() returns from now on
    return raw._body


async def parse_body(raw: Request, model: type[M]) -> M:
    """JSON body -> request model; malformed JSON and bad fields are 400s naming the problem.
    Top-level fields nothing reads are named in a warning line, and the request served."""
    body = await read_body(raw)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got "
                          f"{type(data).__name__}")
    # Only a \uD8xx escape can make one, so most bodies skip the walk.
    where = _lone_surrogate_at(data) if b"\\u" in body else None
    if where is not None:
        raise OpenAIError(400, f"{where or 'the body'}: a string holds a lone UTF-16 surrogate "
                          f"(an unpaired \\ud800-\\udfff escape), which is not valid Unicode "
                          f"text", param=where or None)
    try:
        request = model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error_to_openai(e) from None
    ignored = ignored_fields(request)
    if ignored:
        print(f"server: warning: {raw.url.path}: the following fields were present in the "
              f"request but ignored: {', '.join(map(repr, ignored))}", file=sys.stderr,
              flush=True)
    return request


def _lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in decoded JSON that is not valid
    Unicode (JSON lets ``"\\ud800"`` through; nothing downstream can encode it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            found = _lone_surrogate_at(key, inner)
            if found is None:
                found = _lone_surrogate_at(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def check_prompt_bytes(ctx: ServerContext, text: str, param: str = "prompt") -> None:
    """Refuse, before tokenizing, text too long to fit max_model_len whatever its tokens."""
    tokenizer = ctx.engine.tokenizer
    if tokenizer is None:
        return
    limit = ctx.max_model_len * max(1, tokenizer.max_token_bytes)
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > limit:
        raise OpenAIError(
            400, f"the prompt is {size} bytes, more than max_model_len ({ctx.max_model_len}) "
            f"tokens of at most {tokenizer.max_token_bytes} bytes each can hold; it is not "
            f"truncated", param=param)


def validate_prompt(ctx: ServerContext, ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
    """The engine's own admission checks, run before a response starts (a 400 then)."""
    try:
        ctx.engine.input_processor.check_priority(priority)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="priority") from None
    if params.structured_outputs is not None and ctx.engine.tokenizer is None:
        raise OpenAIError(400, "structured output needs the model's tokenizer, and this "
                          "server runs without one (--skip-tokenizer-init)")
    try:
        ctx.engine.input_processor.process("validate", ids, params)
    except ValueError as e:
        raise OpenAIError(400, str(e), param=getattr(e, "param", None)) from None


async def merged_outputs(engine: AsyncLLM, jobs: list[tuple[Any, SamplingParams, str]],
                         priority: int = 0, cache_salt: str | None = None,
                         ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run several engine requests at once; yield (job index, output) as they arrive.
    Leaving early (a disconnect) cancels every job, which aborts them in the engine.
    ``priority`` and ``cache_salt`` (the request body's) apply to every job; a job's
    prompt is then token ids."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def run(i: int, prompt: Any, params: SamplingParams, rid: str) -> None:
        if cache_salt is not None:
            prompt = {"prompt_token_ids": prompt, "cache_salt": cache_salt}
        try:
            async for out in engine.generate(prompt, params, rid, priority=priority):
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((i, e))
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(run(i, p, sp, rid)) for i, (p, sp, rid) in enumerate(jobs)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def with_keepalive(frames: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass SSE frames through; after VT_SERVER_SSE_PING_S of silence send ':\\n\\n'."""
    interval = envs.VT_SERVER_SSE_PING_S
    if interval <= 0:
        async for frame in frames:
            yield frame
        return
    it = frames.__aiter__()
    pending = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield ":\n\n"
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                return
            yield frame
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        if not pending.done():
            pending.cancel()
        await it.aclose()  # type: ignore[attr-defined]


def usage_info(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached)
                     if cached else None)


def sse(data: Any) -> str:
    """One SSE event; a response model is serialized with its own JSON rules."""
    if isinstance(data, pydantic.BaseModel):
        data = data.model_dump(mode="json")
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def as_openai_error(e: BaseException) -> OpenAIError:
    """What a failed request answers: its own OpenAIError, 503 when the engine core died
    under it, 500 for anything else (the request failed; the server goes on)."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, f"the engine has stopped: {e}")
    if isinstance(e, EngineGenerateError):
        return OpenAIError(500, str(e))
    return OpenAIError(500, f"the request failed inside the server: {type(e).__name__}: {e}")


def error_frame(e: BaseException) -> str:
    return sse(as_openai_error(e).body())


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first; then cancel it (aborting its
    requests in the engine) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not watcher.done():
            watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


class ClientDisconnected(Exception):
    pass


def now() -> int:
    return int(time.time())


# ---- logprobs in the OpenAI shapes (vLLM's rules) ---------------------------------------

_MIN_LOGPROB = -9999.0  # what OpenAI sends for -inf, which JSON cannot carry


def _clamp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _token_text(tokenizer: Any, token_id: int, logprob: Logprob | None = None) -> str:
    """A token's text alone: the engine's decoding when it has one."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    if tokenizer is None:
        return ""
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except ValueError:
        return ""


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or
    {"<token id>": {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [None if step is None else {
        str(token_id): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                        "decoded_token": lp.decoded_token}
        for token_id, lp in step.items()} for step in prompt_logprobs]


def completion_logprobs(token_ids: list[int], steps: list[dict[int, Logprob] | None],
                        tokenizer: Any, initial_text_offset: int = 0) -> CompletionLogProbs:
    """/v1/completions logprobs of ``token_ids`` (with echo, the prompt's first): a step
    without logprobs (the first prompt token) gives null entries; ``top_logprobs`` maps the
    text of the token and of each alternative to its logprob, as vLLM does."""
    out = CompletionLogProbs()
    offset = initial_text_offset
    for token_id, step in zip(token_ids, steps):
        own = step.get(token_id) if step else None
        token = _token_text(tokenizer, token_id, own)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if own is None or not step:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_clamp(own.logprob))
        out.top_logprobs.append({_token_text(tokenizer, t, lp): _clamp(lp.logprob)
                                 for t, lp in step.items()})
    return out


def _chat_logprob(tokenizer: Any, token_id: int, lp: Logprob | None) -> ChatCompletionLogProb:
    token = _token_text(tokenizer, token_id, lp)
    return ChatCompletionLogProb(
        token=token, logprob=_MIN_LOGPROB if lp is None else _clamp(lp.logprob),
        bytes=list(token.encode("utf-8", errors="replace")))


def chat_logprobs(token_ids: list[int], steps: list[dict[int, Logprob] | None], tokenizer: Any,
                  top_logprobs: int) -> ChatCompletionLogProbs:
    """/v1/chat/completions logprobs: per token its logprob and the ``top_logprobs`` most
    likely alternatives by rank (-1: all the engine returned)."""
    content = []
    for token_id, step in zip(token_ids, steps):
        own = step.get(token_id) if step else None
        entry = _chat_logprob(tokenizer, token_id, own)
        ranked = sorted((step or {}).items(), key=lambda item: item[1].rank or 0)
        if top_logprobs >= 0:
            ranked = ranked[:top_logprobs]
        content.append(ChatCompletionLogProbsContent(
            **entry.model_dump(), top_logprobs=[_chat_logprob(tokenizer, t, lp)
                                                 for t, lp in ranked]))
    return ChatCompletionLogProbs(content=content)
