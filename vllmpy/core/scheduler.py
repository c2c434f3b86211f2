"""The token-budget scheduler: continuous batching, chunked prefill, preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllmpy.core.kv_cache_manager import KVCacheManager, cdiv
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


@dataclass
class _StepPlan:
    """What schedule() has decided so far in one step."""

    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    The engine core calls, per step: ``schedule()``, then the model runner, then
    ``update_from_output()``. Requests arrive through ``add_request`` and are aborted
    through ``finish_requests``, both between steps.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # A sequence is never longer than max_model_len, so a pool holding one such
        # sequence can always make progress (at worst by preempting every other request).
        needed = cdiv(max_model_len, kv_cache_manager.block_size)
        if kv_cache_manager.num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {kv_cache_manager.num_blocks} blocks of "
                f"{kv_cache_manager.block_size} tokens, fewer than the {needed} one sequence "
                f"of max_model_len={max_model_len} tokens needs: raise the number of blocks "
                f"or lower max_model_len"
            )
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()  # WAITING and PREEMPTED, front first
        self.running: list[Request] = []  # RUNNING, in admission order
        # Requests that left the runner's batch since the last schedule() (finished,
        # aborted); sent with the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0  # preemptions since start-up (a metric)

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id or an over-long prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {request.num_prompt_tokens} "
                f"tokens, at or past max_model_len={self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, a stop string seen by the frontend).

        Their blocks are freed now and their ids go into the next step's
        ``finished_req_ids``. Ids that are unknown or already finished are ignored.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        """True while finished ids are waiting to be sent to the runner."""
        return bool(self.finished_req_ids)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # Policy (vLLM v1 style, chunked prefill always on). One step computes at most
        # max_num_batched_tokens tokens. A request is owed its uncomputed tokens
        # (num_tokens - num_computed_tokens): the rest of its prompt, or the one token
        # sampled last step. Running requests come first, in order, each given as many
        # of its owed tokens as the budget has left. If the KV pool cannot hold them,
        # the last running request is preempted (its blocks freed, its progress reset,
        # put at the front of the waiting queue) until they fit; if the request being
        # scheduled is itself the last, it is preempted and the running pass stops.
        # Then, if nothing was preempted, waiting requests are admitted in order while
        # budget and seats (max_num_seqs) remain, each with as many owed tokens as the
        # budget allows; the first that does not fit in the pool stops admission.
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)

        finished_req_ids = self.finished_req_ids | {r.request_id for r in plan.preempted}
        self.finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    return
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            plan.cached_reqs.req_ids.append(request.request_id)
            plan.cached_reqs.new_block_ids.append(new_block_ids)
            plan.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.budget -= num_new
            i += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if self.kv_cache_manager.allocate_slots(request, num_new) is None:
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks away; it recomputes prompt + output later.

        The caller has already removed it from ``running``.
        """
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---- after the runner ----------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record what the step computed and sampled; finish requests that are done.

        Returns one EngineCoreOutput per request that got new tokens or finished. A token
        sampled for a request whose scheduled chunk did not reach its last known token
        (a prefill chunk in the middle of the prompt) is discarded.
        """
        sampled_by_id = dict(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)
        )
        outputs: list[EngineCoreOutput] = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since schedule()
            request.num_computed_tokens += num_scheduled
            if request.num_computed_tokens < request.num_tokens:
                continue  # mid-prefill: nothing sampled
            new_token_ids = []
            for token_id in sampled_by_id.get(req_id, ()):
                request.append_output_token_id(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            if new_token_ids or request.is_finished:
                outputs.append(
                    EngineCoreOutput(
                        req_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                    )
                )
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status the just-appended ``token_id`` puts the request in, if any.

        Sets ``request.stop_reason`` when a stop token id ends it.
        """
        params = request.sampling_params
        past_min_tokens = request.num_output_tokens >= params.min_tokens
        if past_min_tokens and token_id in (params.stop_token_ids or ()):
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if past_min_tokens and not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished, free its blocks and forget it. The caller has already
        taken it out of ``running`` / ``waiting``."""
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
