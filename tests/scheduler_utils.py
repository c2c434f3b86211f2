"""Scheduler test helpers: a fake model runner that keeps the runner's persistent batch
from the scheduler's diffs and checks its contract, and ways to build and drive a scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request
from vllmpy.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vllmpy.core.scheduler import Scheduler
from vllmpy.sampling_params import SamplingParams


def token_at(position: int) -> int:
    """What the fake model samples at a position: independent of batching and preemption."""
    return 1000 + position


@dataclass
class _RunnerState:
    num_prompt_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    """Keeps a persistent batch from the scheduler's diffs, the way the model runner does,
    checks the contract on every step, and samples deterministic tokens.

    ``script`` maps a request id to its output tokens by index; other requests get
    ``token_at(position)``. With ``always_sample`` it also returns a (bogus) token for a
    mid-prefill chunk, which the scheduler must discard.
    """

    def __init__(self, kv: KVCacheManager, script=None, always_sample=False):
        self.kv = kv
        self.script: dict[str, list[int]] = script or {}
        self.always_sample = always_sample
        self.reqs: dict[str, _RunnerState] = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = _RunnerState(
                len(new.prompt_token_ids),
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.reqs[req_id]
            assert state.num_computed_tokens == computed
            state.block_ids.extend(new_blocks)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            assert state.block_ids == self.kv.get_block_ids(req_id)
            end = state.num_computed_tokens + n
            assert n > 0 and end <= len(state.token_ids)
            assert len(state.block_ids) * self.kv.block_size >= end
            state.num_computed_tokens = end
            req_ids.append(req_id)
            if end == len(state.token_ids):
                token = self._sample(req_id, state)
                state.token_ids.append(token)
                sampled.append([token])
            elif self.always_sample:
                sampled.append([7777])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _sample(self, req_id: str, state: _RunnerState) -> int:
        if req_id in self.script:
            return self.script[req_id][len(state.token_ids) - state.num_prompt_tokens]
        return token_at(len(state.token_ids))


def make_request(req_id, prompt_len, max_tokens=16, eos=(), priority=0, arrival=0.0,
                 prompt=None, **params) -> Request:
    return Request(
        req_id,
        list(range(1, prompt_len + 1)) if prompt is None else list(prompt),
        SamplingParams(**params),
        set(eos),
        max_tokens,
        arrival,
        priority=priority,
    )


def make_scheduler(num_blocks, block_size, max_num_seqs=8, budget=64, max_model_len=None,
                   caching=False, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    max_model_len = max_model_len or num_blocks * block_size
    return Scheduler(kv, max_num_seqs, budget, max_model_len, policy=policy), kv


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


def run_to_completion(sched, runner, max_steps=1000) -> dict[str, EngineCoreOutput]:
    """Step until every request finished; returns each request's accumulated output."""
    results: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched, runner)
        for out in outputs:
            acc = results.setdefault(out.req_id, EngineCoreOutput(out.req_id, []))
            assert not acc.finished
            acc.new_token_ids += out.new_token_ids
            acc.finish_reason, acc.stop_reason = out.finish_reason, out.stop_reason
    assert not sched.has_unfinished_requests()
    return results
