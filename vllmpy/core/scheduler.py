"""The token-budget scheduler: continuous batching, chunked prefill, preemption, and the
order in which waiting requests are admitted (fcfs, priority, lpm)."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllmpy.core.kv_cache_manager import KVCacheManager, cdiv
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SpecDecodingStats,
)

if TYPE_CHECKING:
    from vllmpy.structured_output.manager import StructuredOutputManager

# While only grammars are compiling, schedule() waits this long for one instead of spinning.
GRAMMAR_WAIT_S = 0.02

# fcfs: arrival order. priority: the request's ``priority`` (lower first), then arrival.
# lpm: longest cached-prefix match first, then arrival (SGLang's cache-aware policy).
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
# With more waiting requests than this, lpm admits in arrival order: matching every one of
# them against the cache each step would cost more than it saves (SGLang's cut-off).
LPM_MAX_WAITING = 128


@dataclass
class _StepPlan:
    """What schedule() has decided so far in one step."""

    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified

    def unschedule_running(self, req_id: str) -> None:
        """Take back a running request scheduled earlier in this step (it was preempted):
        its tokens return to the budget and it leaves the step's diffs."""
        cached = self.cached_reqs
        index = cached.req_ids.index(req_id)
        for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                       cached.new_token_ids):
            if index < len(column):
                del column[index]
        self.budget += self.num_scheduled_tokens.pop(req_id)
        self.spec_tokens.pop(req_id, None)


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    The engine core calls, per step: ``schedule()``, then the model runner, then
    ``update_from_output()``. Requests arrive through ``add_request`` and are aborted
    through ``finish_requests``, both between steps. ``policy`` is one of
    ``SCHEDULING_POLICIES``.

    Speculative decoding (``speculative``): a running request's draft tokens
    (``Request.spec_token_ids``, set from the runner's output) are scheduled after its
    known tokens, so its computed tokens catch up to the tokens including drafts; once
    the step is verified, the rejected drafts are taken back off ``num_computed_tokens``
    (their KV is rewritten by the next step, their slots stay with the request).
    ``num_lookahead_tokens`` more slots are allocated past each step's tokens for a
    proposer that writes KV of its own drafts there (a draft model).
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        structured_output_manager: StructuredOutputManager | None = None,
        speculative: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; choose one of "
                             f"{', '.join(SCHEDULING_POLICIES)}")
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
        self.policy = policy

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # WAITING and PREEMPTED, front first: kept in admission order for fcfs (preempted
        # ones in front) and priority; re-sorted by cache match each step for lpm.
        self.waiting: deque[Request] = deque()
        # Arrival rank of every unfinished request: breaks ties between equal arrival times.
        self._arrival_rank: dict[str, int] = {}
        self._ranks = itertools.count()
        self.running: list[Request] = []  # RUNNING, in admission order
        # Requests that left the runner's batch since the last schedule() (finished,
        # aborted); sent with the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0  # preemptions since start-up (a metric)
        self.structured_output_manager = structured_output_manager
        # Tokens appended by grammar jump-forward since the request's last step: sent to
        # the runner with its next step (CachedRequestData.new_token_ids).
        self._jump_forward_pending: dict[str, list[int]] = {}
        # Requests whose grammar failed to compile: reported by the next update.
        self._grammar_failures: list[EngineCoreOutput] = []
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodingStats() if speculative else None

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for a duplicate id or an over-long prompt."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # a pooling request generates nothing, so its prompt may fill max_model_len
        if request.pooling_params is not None:
            if request.num_prompt_tokens > self.max_model_len:
                raise ValueError(f"request {request.request_id!r}: the prompt has "
                                 f"{request.num_prompt_tokens} tokens, past "
                                 f"max_model_len={self.max_model_len}")
        elif request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {request.num_prompt_tokens} "
                f"tokens, at or past max_model_len={self.max_model_len}"
            )
        if request.priority != 0 and self.policy != "priority":
            raise ValueError(
                f"Got priority {request.priority} but Priority scheduling is not enabled: "
                f"the scheduling policy is {self.policy}; use the priority policy"
            )
        request.status = (RequestStatus.WAITING if request.structured_output_request is None
                          else RequestStatus.WAITING_FOR_FSM)
        self.requests[request.request_id] = request
        self._arrival_rank[request.request_id] = next(self._ranks)
        self._enqueue_waiting(request, front=False)

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
        # of its owed tokens as the budget has left. If the KV pool cannot hold them, a
        # running request is preempted (its blocks freed, its progress reset, queued
        # again) until they fit: the last admitted one, or under the priority policy the
        # one with the largest (priority, arrival); one already scheduled this step gives
        # its tokens back. If the victim is the request being scheduled, the running pass
        # stops. Then, if nothing was preempted, waiting requests are admitted in the
        # policy's order (fcfs: arrival, preempted ones first; priority: lowest priority
        # value, then arrival; lpm: longest cached prefix, then arrival) while budget and
        # seats (max_num_seqs) remain. Each starts from its longest run of cached blocks
        # (never its last token) and gets as many remaining tokens as the budget allows;
        # the first that does not fit in the pool stops admission.
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting_with_grammars(plan)
        so_request_ids, grammar_bitmask = self._grammar_bitmask(plan)

        finished_req_ids = self.finished_req_ids | {r.request_id for r in plan.preempted}
        self.finished_req_ids = set()
        return SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            structured_output_request_ids=so_request_ids,
            grammar_bitmask=grammar_bitmask,
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            pending = request.num_pending_outputs
            if pending and (request.num_output_tokens + pending >= request.max_tokens
                            or request.num_tokens + pending >= self.max_model_len):
                i += 1  # its launched step reaches its last token: nothing more to run
                continue
            owed = request.num_tokens + pending - request.num_computed_tokens
            drafts = self._drafts_that_fit(request)
            num_new = min(owed + len(drafts), plan.budget)
            if num_new <= 0:
                i += 1
                continue
            drafts = drafts[:max(num_new - owed, 0)]  # the budget cuts drafts first
            lookahead = self._lookahead(request, num_new)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new,
                                                                 num_lookahead_tokens=lookahead)
            while new_block_ids is None:
                victim_index = self._victim_index()
                victim = self.running.pop(victim_index)
                if victim_index < i:  # already scheduled this step
                    plan.unschedule_running(victim.request_id)
                    i -= 1
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    return
                new_block_ids = self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead)
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            plan.cached_reqs.req_ids.append(request.request_id)
            plan.cached_reqs.new_block_ids.append(new_block_ids)
            plan.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            plan.cached_reqs.new_token_ids.append(
                self._jump_forward_pending.pop(request.request_id, []))
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.budget -= num_new
            i += 1

    def _drafts_that_fit(self, request: Request) -> list[int]:
        """The request's drafts, cut so that the tokens the step can emit (drafts + 1)
        stay within max_tokens and max_model_len."""
        drafts = request.spec_token_ids
        if not drafts or request.num_pending_outputs:
            return []
        room = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens) - 1
        return drafts[:max(room, 0)]

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots past the step's tokens for the proposer's own drafts (within
        max_model_len)."""
        end = request.num_computed_tokens + num_new
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _victim_index(self) -> int:
        """Which running request to preempt when the pool is full."""
        if self.policy != "priority":
            return len(self.running) - 1
        return max(range(len(self.running)), key=lambda j: self._priority_key(self.running[j]))

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        kv = self.kv_cache_manager
        if self.policy == "lpm" and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            self._sort_waiting_by_prefix_match()
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            if request.pooling_params is not None and request.num_tokens > plan.budget:
                return  # a pooling request is computed whole, in one step
            num_new = min(request.num_tokens - num_hit, plan.budget)
            if kv.allocate_slots(request, num_new, computed_blocks,
                                 self._lookahead(request, num_hit + num_new)) is None:
                return
            kv.record_prefix_lookup(request, num_hit)
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
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
                    pooling_params=request.pooling_params,
                )
            )
            plan.num_scheduled_tokens[request.request_id] = num_new
            plan.budget -= num_new

    def _preempt(self, request: Request) -> None:
        """Take a running request's blocks away; it recomputes prompt + output later.

        The caller has already removed it from ``running``.
        """
        self.kv_cache_manager.free(request)
        self._jump_forward_pending.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_outputs = 0  # a launched step's token for it is dropped
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue_waiting(request, front=True)

    # ---- structured output -----------------------------------------------------------

    def _schedule_waiting_with_grammars(self, plan: _StepPlan) -> None:
        """Admit waiting requests as ``_schedule_waiting`` does, passing over those whose
        grammar still compiles (WAITING_FOR_FSM): they keep their place in the queue and do
        not hold back the ones behind them. A grammar that failed fails its request."""
        held = [r for r in self.waiting if not self._grammar_ready(r)]
        if not held:
            self._schedule_waiting(plan)
            return
        order = [r for r in self.waiting if not r.is_finished]
        self.waiting = deque(r for r in order if r.status != RequestStatus.WAITING_FOR_FSM)
        self._schedule_waiting(plan)
        admitted = {new.req_id for new in plan.new_reqs}
        self.waiting = deque(r for r in order if r.request_id not in admitted)
        waiting_for_fsm = [r for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM]
        if not plan.num_scheduled_tokens and waiting_for_fsm:
            assert self.structured_output_manager is not None
            self.structured_output_manager.wait_for_any(
                [r.structured_output_request for r in waiting_for_fsm], GRAMMAR_WAIT_S)

    def _grammar_ready(self, request: Request) -> bool:
        """False while the request's grammar compiles; a failed one finishes the request
        (finish_reason "error", reported by the next update) and counts as not ready."""
        if request.status != RequestStatus.WAITING_FOR_FSM:
            return True
        try:
            if not request.structured_output_request.ready():
                return False
        except ValueError as e:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._grammar_failures.append(EngineCoreOutput(
                request.request_id, [], finish_reason="error", error=str(e)))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _grammar_bitmask(self, plan: _StepPlan) -> tuple[dict[str, int], np.ndarray | None]:
        """The rows of the step's grammar bitmask: one per grammar request that samples."""
        sampling = []
        for req_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if (request.structured_output_request is not None
                    and request.num_computed_tokens + num_new >= request.num_tokens):
                sampling.append(request)
        if not sampling:
            return {}, None
        assert self.structured_output_manager is not None
        bitmask = self.structured_output_manager.grammar_bitmask(
            [r.structured_output_request for r in sampling])
        return {r.request_id: row for row, r in enumerate(sampling)}, bitmask

    def _advance_grammar(self, request: Request, new_token_ids: list[int]) -> None:
        """Feed the sampled tokens to the request's grammar; then, with jump-forward on,
        append the tokens the grammar forces next to the output (and to new_token_ids):
        the runner computes them with the request's next step, like a prompt chunk.
        Requests asking for logprobs are not jumped (appended tokens have none)."""
        so_request = request.structured_output_request
        so_request.accept_tokens(new_token_ids)
        if request.is_finished or request.sampling_params.logprobs is not None:
            return
        assert self.structured_output_manager is not None
        limit = min(request.max_tokens - request.num_output_tokens,
                    self.max_model_len - request.num_tokens)
        forced = self.structured_output_manager.jump_forward_tokens(so_request, limit)
        if self._append_tokens(request, forced, new_token_ids):
            return
        if forced:
            self._jump_forward_pending.setdefault(request.request_id, []).extend(forced)

    # ---- waiting order ---------------------------------------------------------------

    def _priority_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time,
                self._arrival_rank[request.request_id])

    def _enqueue_waiting(self, request: Request, front: bool) -> None:
        """Queue a new (``front`` False) or preempted (``front`` True) request."""
        if self.policy == "priority":
            bisect.insort(self.waiting, request, key=self._priority_key)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _sort_waiting_by_prefix_match(self) -> None:
        """lpm: the longest cached prefix first, ties (and a long queue) by arrival."""
        kv = self.kv_cache_manager
        if not kv.enable_caching or len(self.waiting) > LPM_MAX_WAITING:
            return
        rank = self._arrival_rank
        self.waiting = deque(sorted(
            self.waiting,
            key=lambda r: (-kv.get_computed_blocks(r)[1], rank[r.request_id])))

    # ---- after the runner ----------------------------------------------------------

    def has_grammar_requests(self) -> bool:
        """Whether a running or waiting request samples under a grammar (its next bitmask
        needs its last token, so no step may be scheduled ahead of that token)."""
        return any(r.structured_output_request is not None for r in self.requests.values())

    def on_launched(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: the step was launched and the next one will be scheduled
        before its results are in. Count its tokens as computed now, and each request
        that samples in it as owing one token whose value the device holds."""
        scheduler_output.launched_ahead = True
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since it was scheduled
            request.num_computed_tokens += num_scheduled
            if request.num_computed_tokens >= request.num_tokens + request.num_pending_outputs:
                request.num_pending_outputs += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Record what the step computed and sampled; finish requests that are done.

        Returns one EngineCoreOutput per request that got new tokens or finished, or whose
        prefill chunk scored prompt logprobs. A token sampled for a request whose
        scheduled chunk did not reach its last known token (a prefill chunk in the middle
        of the prompt) is discarded. Logprobs travel with their tokens, cut to the tokens
        kept.
        """
        sampled_by_id = dict(
            zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)
        )
        logprobs_by_id = dict(zip(model_runner_output.req_ids, model_runner_output.logprobs))
        spec_by_id = dict(zip(model_runner_output.req_ids, model_runner_output.spec_token_ids))
        prompt_logprobs_by_id = model_runner_output.prompt_logprobs
        outputs, self._grammar_failures = self._grammar_failures, []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted since schedule()
            sampled = sampled_by_id.get(req_id, ())
            if scheduler_output.launched_ahead:  # counted at launch; its token is in now
                request.num_pending_outputs = max(0, request.num_pending_outputs - len(sampled))
                mid_prefill = not sampled
            else:
                request.num_computed_tokens += num_scheduled
                mid_prefill = request.num_computed_tokens < request.num_tokens
            if request.pooling_params is not None:
                outputs.append(self._finish_pooling(request,
                                                    model_runner_output.pooled.get(req_id)))
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:  # the rejected drafts' KV is not the request's
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(drafts), len(sampled) - 1)
            self.kv_cache_manager.cache_blocks(request)
            prompt_logprobs = prompt_logprobs_by_id.get(req_id)
            if mid_prefill:
                if prompt_logprobs is not None:  # mid-prefill: only what the chunk scored
                    outputs.append(EngineCoreOutput(req_id, [],
                                                    new_prompt_logprobs=prompt_logprobs))
                continue  # mid-prefill: nothing sampled
            new_token_ids: list[int] = []
            self._append_tokens(request, sampled, new_token_ids)
            num_sampled = len(new_token_ids)
            if request.structured_output_request is not None and new_token_ids:
                self._advance_grammar(request, new_token_ids)
            if not request.is_finished:
                if len(new_token_ids) > 1:  # accepted drafts may fill blocks
                    self.kv_cache_manager.cache_blocks(request)
                request.spec_token_ids = spec_by_id.get(req_id) or []
            new_logprobs = logprobs_by_id.get(req_id)
            if new_token_ids or request.is_finished or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        req_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens or 0,
                        new_logprobs=(None if new_logprobs is None
                                      else new_logprobs.head(num_sampled)),
                        new_prompt_logprobs=prompt_logprobs,
                    )
                )
        return outputs

    def _finish_pooling(self, request: Request, pooled: np.ndarray | None) -> EngineCoreOutput:
        """A pooling request's one step ran: it finishes with its pooled output."""
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        if pooled is None:  # the runner pools every request it computes whole
            return EngineCoreOutput(request.request_id, [], finish_reason="error",
                                    error="the pooling step returned no output for it")
        data = np.ascontiguousarray(pooled, dtype="<f4")
        return EngineCoreOutput(request.request_id, [], finish_reason="stop",
                                num_cached_tokens=request.num_cached_tokens or 0,
                                pooled_data=data.tobytes(), pooled_shape=list(data.shape))

    def _append_tokens(self, request: Request, token_ids: Iterable[int],
                       appended: list[int]) -> bool:
        """Append tokens to a running request (and to ``appended``) until one ends it;
        then finish it and return True."""
        for token_id in token_ids:
            request.append_output_token_id(token_id)
            appended.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                return True
        return False

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
        self._jump_forward_pending.pop(request.request_id, None)
        del self.requests[request.request_id]
        del self._arrival_rank[request.request_id]
        self.finished_req_ids.add(request.request_id)
