"""EngineCore: the busy loop's one step — schedule, execute, update."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from vllmpy import envs
from vllmpy.config import EngineConfig
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import (
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerOutput,
    SchedulerStats,
)
from vllmpy.core.scheduler import Scheduler
from vllmpy.loader.source import ModelSource
from vllmpy.sampling_params import SamplingParams
from vllmpy.worker.model_runner import ModelRunner


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request as the frontend hands it to the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved by the frontend, >= 1
    arrival_time: float


class EngineCore:
    """Owns the scheduler and the model runner. Between steps it takes new requests and
    aborts; ``step()`` runs one batch and returns its deltas with the scheduler's stats."""

    # Utility calls a frontend may make by name (see ``call_utility``).
    UTILITY_METHODS = frozenset({"get_stats", "reset_prefix_cache"})

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model(source)
        self.model_runner.initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(config.cache.num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_model_len=config.model.max_model_len,
        )
        self.eos_token_ids = set(config.model.eos_token_ids)
        # Requests whose first output has not been sent yet -> when they were first
        # scheduled (None until then).
        self._first_scheduled: dict[str, float | None] = {}

    def add_request(self, req: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=req.max_tokens,
            arrival_time=req.arrival_time,
        ))
        self._first_scheduled[req.request_id] = None

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in req_ids:
            self._first_scheduled.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return self.make_outputs([])
        scheduler_output = self.scheduler.schedule()
        self._record_first_scheduled(scheduler_output)
        runner_output = self.model_runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if envs.VT_ENGINE_STEP_LOG:
            self._log_step(scheduler_output)
        return self.make_outputs(outputs, scheduler_output.total_num_scheduled_tokens)

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
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block. There is no prefix cache yet, so nothing is reset."""
        return False

    def call_utility(self, method: str, *args: object) -> object:
        """Run one of ``UTILITY_METHODS`` by name; dataclass results become dicts so they
        travel as plain data."""
        if method not in self.UTILITY_METHODS:
            raise ValueError(f"unknown engine core utility {method!r}; known: "
                             f"{', '.join(sorted(self.UTILITY_METHODS))}")
        result = getattr(self, method)(*args)
        return asdict(result) if isinstance(result, SchedulerStats) else result

    # ---- helpers ------------------------------------------------------------------------

    def _record_first_scheduled(self, scheduler_output: SchedulerOutput) -> None:
        now = time.time()
        for new in scheduler_output.scheduled_new_reqs:
            # A preempted request comes back as new: keep its first time.
            if new.req_id in self._first_scheduled and self._first_scheduled[new.req_id] is None:
                self._first_scheduled[new.req_id] = now

    def _log_step(self, scheduler_output: SchedulerOutput) -> None:
        print(f"vllmpy step: tokens={scheduler_output.total_num_scheduled_tokens} "
              f"running={self.scheduler.num_running} waiting={self.scheduler.num_waiting} "
              f"free_blocks={self.kv_cache_manager.num_free_blocks}", file=sys.stderr)
