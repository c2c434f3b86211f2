"""EngineCore: the busy loop's one step — schedule, execute, update."""

from __future__ import annotations

import atexit
import gc
import sys
import time
from dataclasses import asdict, dataclass

from vllmpy import envs
from vllmpy.config import EngineConfig, log
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from vllmpy.core.scheduler import Scheduler
from vllmpy.loader.source import ModelSource, load_tokenizer
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import SamplingParams
from vllmpy.structured_output.manager import StructuredOutputManager
from vllmpy.worker.model_runner import ModelRunner, StepHandle

# How often a serving engine logs its speculative-decoding line (vLLM's stats interval).
SPEC_LOG_INTERVAL_S = 10.0


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request as the frontend hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved by the frontend, >= 1
    arrival_time: float
    priority: int = 0  # lower first, under the priority scheduling policy
    cache_salt: str | None = None  # shares cached KV only with requests of the same salt
    pooling_params: PoolingParams | None = None  # a pooling request's task (no sampling)


class EngineCore:
    """Owns the scheduler and the model runner. Between steps it takes new requests and
    aborts; ``step()`` runs one batch and returns its deltas with the scheduler's stats."""

    # Utility calls a frontend may make by name (see ``call_utility``).
    UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache"})

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model(source)
        if config.cache.num_blocks == 0:  # CUDA: the pool takes what the profile leaves
            from vllmpy.engine.configure import finish_profiled_pool

            config = finish_profiled_pool(config, *self.model_runner.profile_kv_budget())
            self.model_runner.config = config
        self.config = config
        self.model_runner.initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(config.cache.num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        # Grammars compile on its worker threads; the tokenizer loads there on first use.
        self.structured_output_manager = StructuredOutputManager(
            vocab_size=config.model.text_config.vocab_size,
            stop_token_ids=config.model.eos_token_ids,
            load_tokenizer=lambda: load_tokenizer(source, config.model.tokenizer_config),
            enable_jump_forward=config.enable_jump_forward,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
            policy=config.scheduler.policy,
            structured_output_manager=self.structured_output_manager,
            speculative=config.speculative is not None,
            num_lookahead_tokens=(0 if self.model_runner.proposer is None
                                  else self.model_runner.proposer.num_lookahead_tokens),
        )
        self.eos_token_ids = set(config.model.eos_token_ids)
        # Requests whose first output has not been sent yet -> when they were first
        # scheduled (None until then).
        self._first_scheduled: dict[str, float | None] = {}
        # Async scheduling: the launched step whose results are not read yet.
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        # Speculative decoding's periodic line: the totals and time it last reported.
        self._spec_logged = (SpecDecodingStats(), time.monotonic())
        # Everything built so far lives as long as the engine: keep it out of the
        # collector's generations so a collection never walks it mid-step.
        gc.collect()
        gc.freeze()
        # Frozen objects outlive the interpreter's last collection: handed back at exit,
        # the extension objects they hold (Triton's) are freed rather than reported leaked.
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)

    def add_request(self, req: EngineCoreRequest) -> None:
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            pooling_params=req.pooling_params,
        )
        structured = req.sampling_params.structured_outputs
        if structured is not None:  # its grammar starts compiling now, off the step loop
            request.structured_output_request = self.structured_output_manager.grammar_init(
                req.request_id, structured)
        self.scheduler.add_request(request)
        self._first_scheduled[req.request_id] = None

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in req_ids:
            self._first_scheduled.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    def step(self) -> EngineCoreOutputs:
        if self.config.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return self.make_outputs([])
        scheduler_output = self.scheduler.schedule()
        self._record_first_scheduled(scheduler_output)
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if envs.VT_ENGINE_STEP_LOG:
            self._log_step(scheduler_output)
        return self.make_outputs(outputs, scheduler_output.total_num_scheduled_tokens)

    def _step_async(self) -> EngineCoreOutputs:
        """Async scheduling: while step N runs on the device, schedule and launch step
        N+1, then read N's sampled ids and update. The host's work for one step overlaps
        the device's for the next. N+1 is launched ahead only when nothing it samples
        depends on N's tokens (see ModelRunner.overlap_safe)."""
        try:
            if self._inflight is None:
                if not self.scheduler.has_unfinished_requests():
                    return self.make_outputs([])
                first = self.scheduler.schedule()
                self._record_first_scheduled(first)
                self._inflight = (first, self.model_runner.launch(first))
            current, handle = self._inflight
            ahead = None
            if self.model_runner.overlap_safe and not self.scheduler.has_grammar_requests():
                self.scheduler.on_launched(current)
                nxt = self.scheduler.schedule()
                self._record_first_scheduled(nxt)
                ahead = (nxt, self.model_runner.launch(nxt))
            outputs = self.scheduler.update_from_output(current, handle.result())
            if ahead is not None and not self.scheduler.has_unfinished_requests():
                # every request of the step launched ahead has finished since: drain it
                outputs += self.scheduler.update_from_output(ahead[0], ahead[1].result())
                ahead = None
            self._inflight = ahead
        except BaseException:
            self._inflight = None
            raise
        if envs.VT_ENGINE_STEP_LOG:
            self._log_step(current)
        return self.make_outputs(outputs, current.total_num_scheduled_tokens)

    def fail_running_requests(self, error: str) -> EngineCoreOutputs:
        """After a step raised: end every request in the running batch (the runner's state
        for them may be half-updated) with finish_reason "error", freeing their blocks.
        Waiting requests are untouched, so the engine keeps serving."""
        req_ids = [r.request_id for r in self.scheduler.running]
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        return self.make_outputs([EngineCoreOutput(rid, [], finish_reason="error", error=error)
                                  for rid in req_ids])

    def make_outputs(self, outputs: list[EngineCoreOutput],
                     num_scheduled_tokens: int = 0) -> EngineCoreOutputs:
        """Wrap a step's deltas with the current stats; stamps each request's first
        output with the time it was first scheduled."""
        for out in outputs:
            if out.req_id in self._first_scheduled:
                out.first_scheduled_time = self._first_scheduled.pop(out.req_id)
        return EngineCoreOutputs(outputs, self.get_stats(num_scheduled_tokens), time.time())

    # ---- utility calls ------------------------------------------------------------------

    def get_stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=self.scheduler.num_running,
            num_waiting_reqs=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_scheduled_tokens=num_scheduled_tokens,
            prefix_cache_queries_total=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits_total=self.kv_cache_manager.prefix_cache_hits,
            spec_decoding=(None if self.scheduler.spec_stats is None
                           else self.scheduler.spec_stats.copy()),
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. Refused (False) while any request holds KV blocks, and
        always False with prefix caching off."""
        if not self.kv_cache_manager.enable_caching:
            return False
        return self.kv_cache_manager.reset_prefix_cache()

    def call_utility(self, method: str, *args: object) -> object:
        """Run one of ``UTILITY_METHODS`` by name; dataclass results become dicts so they
        travel as plain data."""
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown engine core utility {method!r}; known: "
                             f"{', '.join(sorted(self.UTILITY_METHODS))}")
        result = getattr(self, method)(*args)
        return asdict(result) if isinstance(result, SchedulerStats) else result

    def log_spec_decoding(self, interval_s: float = SPEC_LOG_INTERVAL_S) -> str | None:
        """At most once per ``interval_s``, with speculative decoding on and drafts
        verified since the last one: log (and return) vLLM's SpecDecoding metrics line
        over the interval."""
        stats = self.scheduler.spec_stats
        last, since = self._spec_logged
        now = time.monotonic()
        if stats is None or now - since < interval_s or stats.num_drafts <= last.num_drafts:
            return None
        self._spec_logged = (stats.copy(), now)
        drafts = stats.num_drafts - last.num_drafts
        drafted = stats.num_draft_tokens - last.num_draft_tokens
        accepted = stats.num_accepted_tokens - last.num_accepted_tokens
        old = last.num_accepted_tokens_per_pos
        per_pos = [(n - (old[i] if i < len(old) else 0)) / drafts
                   for i, n in enumerate(stats.num_accepted_tokens_per_pos)]
        elapsed = now - since
        line = (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / elapsed:.2f} tokens/s, "
                f"Drafted throughput: {drafted / elapsed:.2f} tokens/s, "
                f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}, "
                f"Avg Draft acceptance rate: {100 * accepted / max(drafted, 1):.1f}%")
        log(line)
        return line

    # ---- helpers ------------------------------------------------------------------------

    def _record_first_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        now = time.time()
        for new in scheduler_output.scheduled_new_reqs:
            # A preempted request comes back as new: keep its first time.
            if new.req_id in self._first_scheduled and self._first_scheduled[new.req_id] is None:
                self._first_scheduled[new.req_id] = now

    def _log_step(self, scheduler_output: SchedulerOutput) -> None:
        print(f"vllmpy step: t={time.monotonic():.4f} "
              f"tokens={scheduler_output.total_num_scheduled_tokens} "
              f"new={len(scheduler_output.scheduled_new_reqs)} "
              f"running={self.scheduler.num_running} waiting={self.scheduler.num_waiting} "
              f"free_blocks={self.kv_cache_manager.num_free_blocks}", file=sys.stderr)
