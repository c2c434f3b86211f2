"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import (
    SSE_DONE,
    ServerContext,
    chat_logprobs,
    check_prompt_bytes,
    error_frame,
    merged_outputs,
    now,
    prompt_logprobs_json,
    sse,
    usage_info,
    validate_prompt,
)
from vllmpy.entrypoints.openai.tool_parsers.chat_output import ChoiceStreams, plan_for
from vllmpy.outputs import CompletionOutput
from vllmpy.sampling_params import RequestOutputKind, SamplingParams


def render_chat_prompt(ctx: ServerContext, messages: list[dict[str, Any]],
                       add_generation_prompt: bool, continue_final_message: bool,
                       tools: list[dict[str, Any]] | None,
                       chat_template_kwargs: dict[str, Any] | None,
                       add_special_tokens: bool = False) -> list[int]:
    """The checkpoint's own template, rendered in a sandbox, then tokenized (by default
    without adding special tokens: the template writes them)."""
    tokenizer = ctx.engine.tokenizer
    if tokenizer is None:
        raise OpenAIError(400, "this server has no tokenizer, so it cannot render chat messages")
    if tokenizer.chat_template is None:
        raise OpenAIError(400, "the model has no chat template; use /v1/completions")
    kwargs = {**ctx.default_chat_template_kwargs, **(chat_template_kwargs or {})}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template_kwargs=kwargs)
    except ValueError as e:
        raise OpenAIError(400, f"chat template: {e}", param="messages") from None
    check_prompt_bytes(ctx, text, param="messages")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class ChatHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def prepare(self, req: ChatCompletionRequest, stream: bool):
        self.ctx.check_model(req.model)
        ids = render_chat_prompt(self.ctx, req.template_messages(), req.add_generation_prompt,
                                 req.continue_final_message, req.template_tools(),
                                 req.chat_template_kwargs)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            params = req.to_sampling_params(output_kind=kind)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        plan_for(self.ctx, req, ids).apply(params)  # tool choice and parser needs
        validate_prompt(self.ctx, ids, params, req.priority)
        request_id = random_id("chatcmpl")
        if self.ctx.log_requests:
            # a token is at least one character: the first max_log_len + 1 are enough
            head = ids[:self.ctx.max_log_len + 1]
            tokenizer = self.ctx.engine.tokenizer  # a chat request has one (rendered above)
            assert tokenizer is not None
            prompt = tokenizer.decode(head, skip_special_tokens=False)
            self.ctx.log(request_id, f"chat prompt={self.ctx.clip(prompt)} "
                                     f"prompt_tokens={len(ids)} params={params!r}")
        return request_id, ids, params

    def _logprobs(self, params: SamplingParams,
                  c: CompletionOutput) -> ChatCompletionLogProbs | None:
        """The logprobs of a choice's (new) tokens; None unless asked."""
        if params.logprobs is None:
            return None
        return chat_logprobs(list(c.token_ids), [*(c.logprobs or [])],
                             self.ctx.engine.tokenizer, params.logprobs)

    async def full(self, req: ChatCompletionRequest) -> dict[str, Any]:
        request_id, ids, params = self.prepare(req, stream=False)
        final = None
        async for _, out in merged_outputs(self.ctx.engine, [(ids, params, request_id)],
                                           req.priority, req.cache_salt):
            final = out
        assert final is not None
        choices = []
        plan = plan_for(self.ctx, req, ids)
        for c in final.outputs:
            message, finish_reason = plan.message(c.text, c.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message,
                finish_reason=finish_reason, stop_reason=c.stop_reason,
                logprobs=self._logprobs(params, c)))
            if self.ctx.log_outputs:
                self.ctx.log(request_id, f"output {c.index}: {self.ctx.clip(c.text)}")
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return ChatCompletionResponse(
            id=request_id, model=self.ctx.served_model_name, choices=choices,
            usage=usage_info(len(ids), completion_tokens, final.num_cached_tokens),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs),
        ).model_dump(mode="json")

    async def stream(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                     params: SamplingParams) -> AsyncIterator[str]:
        include_usage, continuous = self.ctx.stream_usage(req.stream_options)
        created = now()
        generated: dict[int, int] = {}
        cached = 0

        def chunk(choices: list[ChatCompletionResponseStreamChoice],
                  usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.ctx.served_model_name,
                choices=choices, usage=usage))

        # the first delta of every choice carries the role
        first = [ChatCompletionResponseStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(params.n)]
        yield chunk(first, usage_info(len(ids), 0) if continuous else None)
        streams = ChoiceStreams(plan_for(self.ctx, req, ids))
        try:
            async for _, out in merged_outputs(self.ctx.engine, [(ids, params, request_id)],
                                               req.priority, req.cache_salt):
                cached = max(cached, out.num_cached_tokens)
                choices = []
                for c in out.outputs:
                    generated[c.index] = generated.get(c.index, 0) + len(c.token_ids)
                    logprobs = self._logprobs(params, c) if c.token_ids else None
                    delta = streams.delta(c.index, c.text, c.finish_reason is not None)
                    if delta is None and c.finish_reason is None and logprobs is None:
                        continue
                    choices.append(ChatCompletionResponseStreamChoice(
                        index=c.index, delta=delta or DeltaMessage(),
                        finish_reason=streams.finish_reason(c.index, c.finish_reason),
                        stop_reason=c.stop_reason,
                        logprobs=logprobs))
                if choices:
                    usage = usage_info(len(ids), sum(generated.values())) if continuous else None
                    yield chunk(choices, usage)
            if include_usage:
                yield chunk([], usage_info(len(ids), sum(generated.values()), cached))
        except Exception as e:  # noqa: BLE001 - a failed request ends its own stream only
            yield error_frame(e)
        yield SSE_DONE
