"""What the pooling endpoints share, and POST /pooling.

A pooling body becomes a list of ``PoolingJob``s, one engine request each; ``run_jobs``
submits them all at once, so the engine batches them, and returns their outputs in order.
What the engine refuses (a task the model does not serve, an input past max_model_len, a
matryoshka size the model lacks) is a ValueError, answered as a 400 with its message.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import torch

from vllmpy.engine.async_llm import EngineGenerateError
from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    PoolingInputRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    UsageInfo,
    random_id,
)
from vllmpy.entrypoints.openai.serving_common import ServerContext, check_prompt_bytes
from vllmpy.outputs import PoolingRequestOutput
from vllmpy.pooling.params import PoolingParams


def check_task(ctx: ServerContext, task: str) -> None:
    """A 400 naming the task and the model unless the engine serves ``task`` ("generate",
    "embed", "classify", "score" or "encode")."""
    try:
        ctx.engine.input_processor.check_task(task)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="model") from None


def check_params(ctx: ServerContext, params: PoolingParams, priority: int) -> None:
    """The engine's checks of what a body asks for besides its inputs (the task, the
    dimensions, the truncation, the priority), run once on a one-token probe before any
    input is submitted: a 400 with the engine's message."""
    try:
        ctx.engine.input_processor.process_pooling("check", [0], params, None, priority)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None


@dataclass
class PoolingJob:
    """One engine request of a pooling body."""

    prompt: Any  # a text, token ids, or either in a dict with its cache_salt
    params: PoolingParams
    param: str  # the body field it came from ("input.2"), named in its refusal
    pair: str | None = None  # a cross-encoder's second text


def prompt_of(ctx: ServerContext, item: str | list[int], params: PoolingParams,
              cache_salt: str | None, param: str) -> Any:
    """An input as the engine takes it. A text too long for max_model_len whatever its
    tokens is refused before tokenizing, unless the request truncates it."""
    if isinstance(item, str) and params.truncate_prompt_tokens is None:
        check_prompt_bytes(ctx, item, param)
    if cache_salt is None:
        return item
    key = "prompt" if isinstance(item, str) else "prompt_token_ids"
    return {key: item, "cache_salt": cache_salt}


def input_jobs(ctx: ServerContext, req: PoolingInputRequest, params: PoolingParams
               ) -> list[PoolingJob]:
    """One job per entry of the body's ``input``."""
    items = req.inputs()
    names = ["input"] if len(items) == 1 else [f"input.{i}" for i in range(len(items))]
    return [PoolingJob(prompt_of(ctx, item, params, req.cache_salt, name), params, name)
            for item, name in zip(items, names)]


async def run_jobs(ctx: ServerContext, jobs: list[PoolingJob], request_id: str,
                   priority: int = 0) -> list[PoolingRequestOutput]:
    """Every job's output, in order, the jobs running side by side. The first failure
    ends the call (a ValueError as a 400 naming the job's field) and, like leaving early
    (a disconnect cancels the caller), cancels the jobs still running, which aborts them
    in the engine."""

    async def run(i: int, job: PoolingJob) -> PoolingRequestOutput:
        final = None
        try:
            async for out in ctx.engine.encode(job.prompt, job.params, f"{request_id}-{i}",
                                               pair=job.pair, priority=priority):
                final = out
        except ValueError as e:
            raise OpenAIError(400, str(e), param=job.param) from None
        if final is None:
            raise EngineGenerateError(f"pooling request {request_id}-{i} gave no output")
        return final

    tasks = [asyncio.ensure_future(run(i, job)) for i, job in enumerate(jobs)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:  # the first failure by input order among those ended
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(outs: list[PoolingRequestOutput]) -> UsageInfo:
    tokens = sum(len(out.prompt_token_ids) for out in outs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def encode_vector(data: torch.Tensor, encoding_format: str) -> list[Any] | str:
    """A float tensor as JSON numbers (nested for 2-D), or as base64 of its flattened
    little-endian float32 bytes."""
    if encoding_format == "base64":
        raw = data.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4")
        return base64.b64encode(raw.tobytes()).decode("ascii")
    return data.tolist()


def log_jobs(ctx: ServerContext, request_id: str, what: str, jobs: list[PoolingJob]) -> None:
    if not ctx.log_requests:
        return
    shown = ", ".join(ctx.clip(str(job.prompt)) + ("" if job.pair is None else
                                                   f" / {ctx.clip(job.pair)}")
                      for job in jobs)
    ctx.log(request_id, f"{what} inputs=[{shown}] params={jobs[0].params!r}")


class PoolingHandler:
    """POST /pooling: the model's output per input, as it comes (vLLM's endpoint)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def full(self, req: PoolingRequest) -> dict[str, Any]:
        self.ctx.check_model(req.model)
        params = req.to_pooling_params()
        check_task(self.ctx, params.task)
        check_params(self.ctx, params, req.priority)
        request_id = random_id("pool")
        jobs = input_jobs(self.ctx, req, params)
        log_jobs(self.ctx, request_id, f"pooling ({params.task})", jobs)
        outs = await run_jobs(self.ctx, jobs, request_id, req.priority)
        data = [PoolingResponseData(index=i, data=encode_vector(out.outputs.data,
                                                                req.encoding_format))
                for i, out in enumerate(outs)]
        return PoolingResponse(id=request_id, model=self.ctx.served_model_name, data=data,
                               usage=usage(outs)).model_dump(mode="json")
