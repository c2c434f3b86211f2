"""AsyncLLM: per-request async streams over the engine core, for the server (vLLM's
``AsyncLLM``).

Each ``generate`` registers a queue; one background task on the event loop reads the
core's outputs, turns them into RequestOutputs and fills the queues. An AsyncLLM serves
one event loop: the one running its first ``generate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

from vllmpy.config import EngineArgs, EngineConfig, ModelConfig
from vllmpy.core.sched_output import EngineCoreOutputs, SchedulerStats
from vllmpy.engine import core_launch
from vllmpy.engine.configure import build_engine_config, model_source
from vllmpy.engine.core_client import (
    AsyncInprocClient,
    EngineDeadError,
    EngineStartupError,
)
from vllmpy.engine.input_processor import InputProcessor, PromptType
from vllmpy.engine.mp_client import AsyncMPClient
from vllmpy.engine.output_processor import OutputProcessor
from vllmpy.loader.load_stats import LoadStats
from vllmpy.loader.source import ModelSource, load_tokenizer
from vllmpy.outputs import (
    CompletionOutput,
    FinishedRequestStats,
    IterationStats,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineGenerateError", "EngineStartupError"]

# Called with the core's latest scheduler stats and what the batch did.
StatListener = Callable[[SchedulerStats | None, IterationStats], None]


class EngineGenerateError(RuntimeError):
    """The engine failed this one request (an internal error in its step); the engine
    keeps serving the others."""


@dataclass
class _RequestState:
    """What AsyncLLM keeps per generate() call."""

    queue: asyncio.Queue[Any]  # RequestOutputs (PoolingRequestOutputs) or an error
    metrics: RequestMetrics  # inter_token_latencies: intervals not yet handed out
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    failed: bool = False  # an error or an abort has been queued: nothing more goes in
    counted: bool = False  # its end is in the metrics already
    pooling: bool = False  # an encode() call: its outputs are PoolingRequestOutputs


class AsyncLLM:
    """``AsyncLLM.from_engine_args(args)`` starts the engine core (in its own process by
    default) and returns once it is ready.

    ``generate()`` yields RequestOutputs as ``sampling_params.output_kind`` asks (DELTA
    for streaming, FINAL_ONLY for one final output). A bad prompt raises ValueError
    before anything reaches the core. A consumer that stops early aborts its request.
    A request the engine fails raises EngineGenerateError; a dead engine makes every
    generate, in flight or new, and ``check_health`` raise EngineDeadError.
    """

    def __init__(self, engine_args: EngineArgs, config: EngineConfig, source: ModelSource,
                 tokenizer: Any | None, client: AsyncMPClient | AsyncInprocClient) -> None:
        self.engine_args = engine_args
        self.config = config
        self.served_source = source
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(config.model, tokenizer, config.scheduler.policy)
        self.output_processor = OutputProcessor(tokenizer)
        self.client = client
        # Called after each batch of outputs with the core's latest stats (the server's
        # metrics logger subscribes here).
        self.stat_listeners: list[StatListener] = []
        self.errored = False
        self.dead_error: BaseException | None = None
        self._requests: dict[str, _RequestState] = {}
        self._output_task: asyncio.Task[None] | None = None
        self._latest_stats: SchedulerStats | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, multiprocess: bool = True,
                         launched: core_launch.CoreLaunch | None = None) -> AsyncLLM:
        """Start the core and return once it is ready; the tokenizer loads here while the
        core loads the model. In its own process (the default) the core is started from
        the arguments, resolves the model and builds the config itself and sends them
        here; ``launched`` is such a core started earlier (the server starts it before
        importing torch). A bad argument raises what the config raised (ConfigError)."""
        args = engine_args
        stats = LoadStats()
        if not multiprocess:
            with stats.phase("config"):
                source = model_source(args)
                config = build_engine_config(args, source)
            with stats.phase("tokenizer"):
                tokenizer = load_tokenizer(source, args.tokenizer_config,
                                           skip=args.skip_tokenizer_init)
            with stats.phase("engine_core"):
                client: AsyncMPClient | AsyncInprocClient = AsyncInprocClient(config, source)
            stats.report()
            config = client.engine_core.config  # with the KV pool sized
            return cls(args, config, source, tokenizer, client)
        if launched is None:
            launched = core_launch.launch(args, core_launch.probable_device(args.device))
        client = AsyncMPClient(launched)
        try:
            with stats.phase("config"):
                config, source = client.wait_for_config()
            with stats.phase("tokenizer"):
                tokenizer = load_tokenizer(source, args.tokenizer_config,
                                           skip=args.skip_tokenizer_init)
            with stats.phase("engine_core"):
                config = client.wait_until_ready()
        except BaseException:
            client.shutdown()
            raise
        stats.report()
        return cls(args, config, source, tokenizer, client)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests -----------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, *, prompt_token_ids_hint: list[int] | None = None,
                       priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one prompt. ``prompt_token_ids_hint``: the prompt's token
        ids when the caller has them already (a rendered chat); ``prompt`` then only
        supplies the text echoed in the outputs. ``priority``: lower first, only under the
        priority scheduling policy."""
        self._raise_if_dead()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process_prompt(request_id, prompt, sampling_params,
                                                        prompt_token_ids_hint, priority)
        self._ensure_output_task()
        state = _RequestState(
            queue=asyncio.Queue(),
            metrics=RequestMetrics(arrival_time=processed.core_requests[0].arrival_time,
                                   num_prompt_tokens=len(processed.prompt_token_ids)),
            prompt=processed.prompt, prompt_token_ids=processed.prompt_token_ids,
            n=len(processed.child_params), max_tokens=processed.core_requests[0].max_tokens)
        self._requests[request_id] = state
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, processed.child_params)
        finished = False
        try:
            for req in processed.core_requests:
                await self.client.add_request(req)
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._requests.pop(request_id, None)
            if not finished:
                self._count_end(state, "abort")
                self._abort_in_background(request_id)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str, *, pair: str | None = None,
                     priority: int = 0) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Run one pooling request (vLLM's ``AsyncLLM.encode``): yields its one
        PoolingRequestOutput. ``pair``: the second text of a cross-encoder's pair."""
        self._raise_if_dead()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process_pooling(request_id, prompt, pooling_params,
                                                         pair, priority)
        self._ensure_output_task()
        state = _RequestState(
            queue=asyncio.Queue(),
            metrics=RequestMetrics(arrival_time=processed.core_requests[0].arrival_time,
                                   num_prompt_tokens=len(processed.prompt_token_ids)),
            prompt=processed.prompt, prompt_token_ids=processed.prompt_token_ids,
            n=1, max_tokens=1, pooling=True)
        self._requests[request_id] = state
        self.output_processor.add_request(request_id, processed.prompt,
                                          processed.prompt_token_ids, processed.child_params,
                                          pooling=True)
        finished = False
        try:
            await self.client.add_request(processed.core_requests[0])
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.outputs.data is None:
                    raise EngineGenerateError(f"pooling request {request_id!r} was aborted")
                yield item
        finally:
            self._requests.pop(request_id, None)
            if not finished:
                self._count_end(state, "abort")
                self._abort_in_background(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request: the core frees its blocks, and its generate() ends with a
        final output whose unfinished completions have finish_reason "abort"."""
        child_ids = self.output_processor.abort(request_id)
        state = self._requests.get(request_id)
        if state is not None and not state.failed and state.pooling:
            state.failed = True
            self._count_end(state, "abort")
            state.queue.put_nowait(PoolingRequestOutput(
                request_id, PoolingOutput(None), state.prompt_token_ids, True, state.prompt))
        elif state is not None and not state.failed:
            state.failed = True
            self._count_end(state, "abort")
            state.queue.put_nowait(RequestOutput(
                request_id, state.prompt, state.prompt_token_ids,
                [CompletionOutput(i, "", [], finish_reason="abort") for i in range(state.n)],
                finished=True, metrics=replace(state.metrics)))
        if child_ids and self.dead_error is None:
            await self.client.abort_requests(child_ids)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine core is dead."""
        self._raise_if_dead()

    @property
    def is_dead(self) -> bool:
        """Whether the engine core is dead (checked now, not at the last output)."""
        try:
            self._raise_if_dead()
        except EngineDeadError:
            return True
        return False

    @property
    def num_in_flight(self) -> int:
        """generate() calls not yet ended."""
        return len(self._requests)

    async def reset_prefix_cache(self) -> bool:
        self._raise_if_dead()
        return bool(await self.client.call_utility("reset_prefix_cache"))

    def get_stats(self) -> SchedulerStats | None:
        """The scheduler stats of the core's latest output (None before the first)."""
        return self._latest_stats

    def shutdown(self) -> None:
        task = self._output_task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                task.cancel()
        self.client.shutdown()
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine has been shut down")

    # ---- the output task ----------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        if self._output_task is None:
            loop = asyncio.get_running_loop()
            self._output_task = loop.create_task(self._output_loop(), name="vllmpy-outputs")

    async def _output_loop(self) -> None:
        try:
            while True:
                batch = await self.client.get_output()
                to_abort = self._process_batch(batch)
                if to_abort:
                    await self.client.abort_requests(to_abort)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._mark_dead(e)
        except BaseException as e:
            traceback.print_exc()
            self._mark_dead(EngineDeadError(f"the output loop failed: {type(e).__name__}: {e}"))

    def _process_batch(self, batch: EngineCoreOutputs) -> list[str]:
        """Hand one batch of core outputs to the waiting generate() calls; returns the
        child ids a stop string finished, which the core must abort."""
        iteration = self._record_core_outputs(batch)
        outputs, to_abort = self.output_processor.process_outputs(batch.outputs)
        for request_id, error in self.output_processor.take_failures():
            self._fail_request(request_id, error, iteration)
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None or state.failed:
                continue
            out.metrics = self._take_metrics(state, out.finished, batch.timestamp)
            if out.finished:
                reason = ("stop" if isinstance(out, PoolingRequestOutput) else
                          next((c.finish_reason for c in out.outputs if c.finish_reason),
                               "stop"))
                self._count_end(state, reason, iteration, batch.timestamp)
            state.queue.put_nowait(out)
        if batch.scheduler_stats is not None:
            self._latest_stats = batch.scheduler_stats
        self._notify_listeners(iteration)
        return to_abort

    def _record_core_outputs(self, batch: EngineCoreOutputs) -> IterationStats:
        """Timing per request, what the batch did, and the requests the core failed."""
        now = batch.timestamp
        iteration = IterationStats()
        timed: set[str] = set()  # one token interval per request and step, not per child
        for out in batch.outputs:
            parent_id = self.output_processor.child_to_parent.get(out.req_id)
            state = self._requests.get(parent_id) if parent_id is not None else None
            if parent_id is None or state is None:
                continue
            m = state.metrics
            if out.pooled_data is not None:  # a pooling request's one step: its prompt
                iteration.num_prompt_tokens += m.num_prompt_tokens
            if out.new_token_ids:
                iteration.num_generation_tokens += len(out.new_token_ids)
                last = m.last_token_time
                if parent_id not in timed and last is None:
                    iteration.num_prompt_tokens += m.num_prompt_tokens
                    iteration.time_to_first_tokens.append(max(now - m.arrival_time, 0.0))
                elif parent_id not in timed and last is not None:
                    iteration.inter_token_latencies.append(max(now - last, 0.0))
            m.observe_step(out.first_scheduled_time, len(out.new_token_ids), now,
                           parent_id not in timed)
            if out.new_token_ids:
                timed.add(parent_id)
            if out.finish_reason == "error":
                self._fail_request(parent_id, out.error, iteration)
        return iteration

    def _fail_request(self, request_id: str, error: str | None,
                      iteration: IterationStats | None = None) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state.failed:
            state.failed = True
            self._count_end(state, "error", iteration)
            state.queue.put_nowait(EngineGenerateError(
                f"request {request_id!r} failed in the engine: {error}"))

    def _count_end(self, state: _RequestState, reason: str,
                   iteration: IterationStats | None = None, now: float | None = None) -> None:
        """Put a request's end into the metrics once: into ``iteration`` when it ended in
        a batch, otherwise (an abort) at once."""
        if state.counted:
            return
        state.counted = True
        ended = FinishedRequestStats(
            reason, replace(state.metrics, finished_time=now or time.time(),
                            inter_token_latencies=[]), state.n, state.max_tokens)
        if iteration is not None:
            iteration.finished.append(ended)
        else:
            self._notify_listeners(IterationStats(finished=[ended]))

    @staticmethod
    def _take_metrics(state: _RequestState, finished: bool, now: float) -> RequestMetrics:
        m = state.metrics
        snapshot = replace(m, finished_time=now if finished else None)
        m.inter_token_latencies = []
        return snapshot

    def _notify_listeners(self, iteration: IterationStats) -> None:
        for listener in list(self.stat_listeners):
            try:
                listener(self._latest_stats, iteration)
            except Exception:
                print("vllmpy: a stat listener failed:", file=sys.stderr)
                traceback.print_exc()

    # ---- failure ------------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self.dead_error is None:
            try:
                self.client.check_alive()
            except EngineDeadError as e:
                self._mark_dead(e)
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def _mark_dead(self, error: BaseException) -> None:
        if self.dead_error is None:
            self.dead_error = error
        self.errored = True
        for state in self._requests.values():
            self._count_end(state, "error")
            state.failed = True
            state.queue.put_nowait(EngineDeadError(str(error)))

    def _abort_in_background(self, request_id: str) -> None:
        """Abort a request whose consumer went away (it may be inside a finally block of
        a cancelled task, so nothing here awaits)."""
        child_ids = self.output_processor.abort(request_id)
        if not child_ids or self.dead_error is not None:
            return
        try:
            task = asyncio.get_running_loop().create_task(self.client.abort_requests(child_ids))
        except RuntimeError:  # no running loop: the generator was collected at exit
            return
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a dead engine is reported elsewhere
