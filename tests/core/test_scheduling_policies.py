"""Scheduling policies: priority (admission and preemption order) and lpm (admission by
longest cached prefix), driven by the fake runner with exact ids."""

from __future__ import annotations

import pytest
from scheduler_utils import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    token_at,
)

from vllmpy.core import scheduler as scheduler_module
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import RequestStatus
from vllmpy.core.scheduler import Scheduler


def admission_order(sched, runner, max_steps=200) -> list[str]:
    """Step to completion; the request ids in the order they were first admitted."""
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return order
        so, _ = step(sched, runner)
        order += [n.req_id for n in so.scheduled_new_reqs if n.req_id not in order]
    raise AssertionError("the requests did not finish")


# ---- priority ------------------------------------------------------------------------


def test_priority_admits_lowest_value_first_then_earliest_arrival():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1, policy="priority")
    for req_id, priority, arrival in [("w", 2, 0.0), ("x", 0, 1.0), ("y", 1, 2.0),
                                      ("v", 0, 1.0), ("z", 0, 0.5)]:
        sched.add_request(make_request(req_id, 4, max_tokens=1, priority=priority,
                                       arrival=arrival))
    # z arrived first among priority 0; x and v arrived together: the one added first
    assert admission_order(sched, FakeRunner(kv)) == ["z", "x", "v", "y", "w"]


def _three_running(policy, priorities):
    """a (4 prompt tokens) runs first; b and c (7 each) join at the next step, filling all
    six blocks. Two steps later b needs a third block."""
    sched, kv = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, policy=policy)
    runner = FakeRunner(kv)
    reqs = {rid: make_request(rid, n, max_tokens=6, priority=p, arrival=t)
            for (rid, n, t), p in zip([("a", 4, 0.0), ("b", 7, 1.0), ("c", 7, 2.0)],
                                      priorities)}
    sched.add_request(reqs["a"])
    step(sched, runner)
    sched.add_request(reqs["b"])
    sched.add_request(reqs["c"])
    so, _ = step(sched, runner)
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [
        ("b", [2, 3]), ("c", [4, 5])]
    assert kv.num_free_blocks == 0
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    return sched, kv, runner, reqs


def test_fcfs_preempts_the_last_admitted_request():
    sched, kv, runner, reqs = _three_running("fcfs", [0, 0, 0])
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.new_block_ids == [[], [5]]
    assert reqs["c"].status == RequestStatus.PREEMPTED


def test_priority_preempts_the_lowest_priority_request_even_if_already_scheduled():
    # a has the largest priority value (the lowest priority) and was scheduled first in
    # this step: it gives back its token, and b takes the block a freed last (its first)
    sched, kv, runner, reqs = _three_running("priority", [5, 0, 1])
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}
    assert so.total_num_scheduled_tokens == 2
    assert so.scheduled_cached_reqs.req_ids == ["b", "c"]
    assert so.scheduled_cached_reqs.new_block_ids == [[1], [0]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8, 8]
    a = reqs["a"]
    assert (a.status, a.num_computed_tokens, a.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1)
    assert sched.running == [reqs["b"], reqs["c"]]

    # back in the queue, a waits behind a later arrival of higher priority
    sched.add_request(make_request("d", 3, max_tokens=1, priority=3, arrival=9.0))
    assert [r.request_id for r in sched.waiting] == ["d", "a"]
    assert admission_order(sched, runner) == ["d", "a"]
    # preemption costs a recompute, never different tokens
    assert reqs["a"].output_token_ids == [token_at(p) for p in range(4, 10)]
    assert kv.num_free_blocks == 6


# ---- lpm -----------------------------------------------------------------------------


def _warm(policy, caching=True):
    """A scheduler whose cache holds the 4 blocks of tokens 1..16."""
    sched, kv = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, budget=64,
                               caching=caching, policy=policy)
    runner = FakeRunner(kv)
    sched.add_request(make_request("warm", 16, max_tokens=1))
    run_to_completion(sched, runner)
    for req_id, matched, tail in [("x", 0, 100), ("y", 8, 200), ("z", 4, 300),
                                  ("w", 12, 400), ("u", 8, 500)]:
        prompt = list(range(1, matched + 1)) + list(range(tail, tail + 16 - matched))
        sched.add_request(make_request(req_id, 16, max_tokens=1, prompt=prompt))
    return sched, kv, runner


def test_lpm_admits_the_longest_cached_prefix_first_then_by_arrival():
    sched, kv, runner = _warm("lpm")
    so, _ = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("w", 12)
    assert admission_order(sched, runner) == ["y", "u", "z", "x"]


def test_fcfs_admits_the_same_requests_in_arrival_order():
    sched, kv, runner = _warm("fcfs")
    assert admission_order(sched, runner) == ["x", "y", "z", "w", "u"]


def test_lpm_falls_back_to_arrival_order_without_caching_or_with_a_long_queue(monkeypatch):
    sched, kv, runner = _warm("lpm", caching=False)
    assert admission_order(sched, runner) == ["x", "y", "z", "w", "u"]
    monkeypatch.setattr(scheduler_module, "LPM_MAX_WAITING", 4)
    sched, kv, runner = _warm("lpm")
    # 5 waiting: arrival order admits x; then 4 waiting: sorted by match
    assert admission_order(sched, runner) == ["x", "w", "y", "u", "z"]


# ---- refusals ------------------------------------------------------------------------


def test_unknown_policy_and_priority_without_the_priority_policy_are_refused():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'; choose one of "
                                         "fcfs, priority, lpm"):
        Scheduler(kv, 4, 16, 16, policy="sjf")
    for policy in ("fcfs", "lpm"):
        sched, _ = make_scheduler(num_blocks=8, block_size=4, policy=policy)
        with pytest.raises(ValueError, match=f"Got priority 3 but Priority scheduling is "
                                             f"not enabled: the scheduling policy is {policy}"):
            sched.add_request(make_request("a", 3, priority=3))
        assert not sched.has_unfinished_requests()
