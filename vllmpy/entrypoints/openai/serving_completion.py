"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServerContext,
    check_prompt_bytes,
    completion_logprobs,
    error_frame,
    merged_outputs,
    now,
    prompt_logprobs_json,
    sse,
    usage_info,
    validate_prompt,
)
from vllmpy.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from vllmpy.sampling_params import RequestOutputKind, SamplingParams


def _prompts(ctx: ServerContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """Normalize the four prompt forms to (text or None, token ids)."""
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [list(p)]  # type: ignore[arg-type]
    else:
        items = list(p)  # type: ignore[arg-type]
    out = []
    for item in items:
        if isinstance(item, str):
            check_prompt_bytes(ctx, item)
        try:
            out.append(ctx.engine.input_processor.tokenize(item))
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt") from None
    return out


class CompletionHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def prepare(self, req: CompletionRequest, stream: bool):
        """Validate everything before a response starts; returns the engine jobs."""
        self.ctx.check_model(req.model)
        prompts = _prompts(self.ctx, req)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            params = req.to_sampling_params(output_kind=kind)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        request_id = random_id("cmpl")
        jobs = []
        for i, (_, ids) in enumerate(prompts):
            validate_prompt(self.ctx, ids, params, req.priority)
            jobs.append((ids, params, f"{request_id}-{i}"))
        if self.ctx.log_requests:
            shown = ", ".join(self.ctx.clip(t) if t is not None else self.ctx.clip(str(ids))
                              for t, ids in prompts)
            self.ctx.log(request_id, f"completion prompts=[{shown}] params={params!r}")
        return request_id, prompts, params, jobs

    def _echo(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        tok = self.ctx.engine.tokenizer
        return tok.decode(ids, skip_special_tokens=False) if tok is not None else ""

    def _logprobs(self, params: SamplingParams, c: CompletionOutput,
                  echo_ids: list[int] | None, prompt_logprobs: PromptLogprobs | None,
                  text_offset: int = 0) -> CompletionLogProbs | None:
        """A choice's logprobs (None unless asked); with echo, the prompt tokens' first."""
        if params.logprobs is None:
            return None
        token_ids = list(c.token_ids)
        steps: PromptLogprobs = list(c.logprobs or [])
        if echo_ids is not None:
            token_ids = [*echo_ids, *token_ids]
            steps = [*(prompt_logprobs or [None] * len(echo_ids)), *steps]
        return completion_logprobs(token_ids, steps, self.ctx.engine.tokenizer, text_offset)

    async def full(self, req: CompletionRequest) -> dict[str, Any]:
        request_id, prompts, params, jobs = self.prepare(req, stream=False)
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged_outputs(self.ctx.engine, jobs, req.priority,
                                           req.cache_salt):
            finals[i] = out
        choices = []
        completion_tokens = cached = 0
        for i, (text, ids) in enumerate(prompts):
            out = finals[i]
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                body = (self._echo(text, ids) if req.echo else "") + c.text
                choices.append(CompletionResponseChoice(
                    index=i * params.n + c.index, text=body, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=self._logprobs(params, c, ids if req.echo else None,
                                            out.prompt_logprobs),
                    prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)))
                if self.ctx.log_outputs:
                    self.ctx.log(request_id, f"output {c.index}: {self.ctx.clip(c.text)}")
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return CompletionResponse(
            id=request_id, model=self.ctx.served_model_name, choices=choices,
            usage=usage_info(prompt_tokens, completion_tokens, cached)).model_dump(mode="json")

    async def stream(self, req: CompletionRequest, request_id: str, prompts, params: SamplingParams,
                     jobs) -> AsyncIterator[str]:
        include_usage, continuous = self.ctx.stream_usage(req.stream_options)
        created = now()
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        generated: dict[int, int] = {}
        echoed: set[int] = set()
        cached: dict[int, int] = {}  # per prompt
        text_offsets: dict[int, int] = {}  # per choice: the text sent so far (logprobs)

        def chunk(choices: list[CompletionResponseStreamChoice],
                  usage: UsageInfo | None = None) -> str:
            return sse(CompletionStreamResponse(
                id=request_id, created=created, model=self.ctx.served_model_name,
                choices=choices, usage=usage))

        try:
            async for i, out in merged_outputs(self.ctx.engine, jobs, req.priority,
                                               req.cache_salt):
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                choices = []
                for c in out.outputs:
                    index = i * params.n + c.index
                    text = c.text
                    echo_ids = None
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = self._echo(*prompts[i]) + text
                        echo_ids = prompts[i][1]
                    generated[index] = generated.get(index, 0) + len(c.token_ids)
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    offset = text_offsets.get(index, 0)
                    text_offsets[index] = offset + len(text)
                    choices.append(CompletionResponseStreamChoice(
                        index=index, text=text, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        logprobs=self._logprobs(params, c, echo_ids, out.prompt_logprobs,
                                                offset)))
                if choices:
                    usage = (usage_info(prompt_tokens, sum(generated.values()))
                             if continuous else None)
                    yield chunk(choices, usage)
            if include_usage:
                yield chunk([], usage_info(prompt_tokens, sum(generated.values()),
                                           sum(cached.values())))
        except Exception as e:  # noqa: BLE001 - a failed request ends its own stream only
            yield error_frame(e)
        yield SSE_DONE
