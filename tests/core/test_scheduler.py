"""Scheduler behaviour, driven by a fake model runner, with exact block ids."""

from __future__ import annotations

import random

import pytest
from scheduler_utils import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    token_at,
)

from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import RequestStatus
from vllmpy.core.sched_output import EngineCoreOutput, ModelRunnerOutput
from vllmpy.core.scheduler import Scheduler

# ---- chunked prefill and continuous batching -------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    sched, kv = make_scheduler(num_blocks=16, block_size=16, budget=32)
    runner = FakeRunner(kv, always_sample=True)
    req = make_request("a", 100, max_tokens=3)
    sched.add_request(req)

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 32}
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs] == [
        ("a", [0, 1], 0)
    ]
    assert outs == [] and req.output_token_ids == []  # the bogus mid-prefill token is dropped

    expected = [(32, [2, 3], 32), (32, [4, 5], 64), (4, [6], 96)]
    for num_tokens, new_blocks, computed in expected:
        so, outs = step(sched, runner)
        assert so.scheduled_new_reqs == []
        assert so.num_scheduled_tokens == {"a": num_tokens}
        assert so.scheduled_cached_reqs.new_block_ids == [new_blocks]
        assert so.scheduled_cached_reqs.num_computed_tokens == [computed]
    assert outs == [EngineCoreOutput("a", [token_at(100)])]
    assert req.num_computed_tokens == 100

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    assert outs == [EngineCoreOutput("a", [token_at(101)])]
    so, outs = step(sched, runner)
    assert outs == [EngineCoreOutput("a", [token_at(102)], finish_reason="length")]
    assert req.output_token_ids == [1100, 1101, 1102]
    assert kv.num_free_blocks == 16
    assert sched.schedule().finished_req_ids == {"a"}


def test_new_request_joins_while_others_decode_and_shares_the_token_budget():
    sched, kv = make_scheduler(num_blocks=32, block_size=4, budget=4)
    runner = FakeRunner(kv)
    sched.add_request(make_request("a", 3))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 3}
    assert outs == [EngineCoreOutput("a", [token_at(3)])]

    sched.add_request(make_request("b", 6))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}  # decode first, prefill gets the rest
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [("b", [1])]
    assert outs == [EngineCoreOutput("a", [token_at(4)])]

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert so.scheduled_cached_reqs.new_block_ids == [[2], [3]]
    assert outs == [EngineCoreOutput("a", [token_at(5)]), EngineCoreOutput("b", [token_at(6)])]

    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.total_num_scheduled_tokens == 2


def test_max_num_seqs_limits_the_seats():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    runner = FakeRunner(kv)
    sched.add_request(make_request("a", 4, max_tokens=2))
    sched.add_request(make_request("b", 4, max_tokens=5))
    sched.add_request(make_request("c", 4, max_tokens=1))
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"a", "b"}
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert outs[0] == EngineCoreOutput("a", [token_at(5)], finish_reason="length")
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert so.num_scheduled_tokens == {"b": 1, "c": 4}
    # a held [0, 2] and b took 3 in the last step: c gets the next never-used block
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [("c", [4])]
    assert kv.block_pool.free_block_ids()[-3:] == [2, 0, 4]  # c (max_tokens=1) is done too
    run_to_completion(sched, runner)
    assert kv.num_free_blocks == 16


def test_nothing_to_do_gives_an_empty_step():
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {} and so.total_num_scheduled_tokens == 0
    assert so.scheduled_new_reqs == [] and so.finished_req_ids == set()
    assert sched.update_from_output(so, ModelRunnerOutput([], [])) == []


# ---- preemption ------------------------------------------------------------------------


def test_preemption_takes_the_last_running_request_which_resumes_first():
    sched, kv = make_scheduler(num_blocks=6, block_size=4, max_model_len=24)
    runner = FakeRunner(kv)
    a = make_request("a", 8, max_tokens=3)
    b = make_request("b", 8, max_tokens=6)
    c = make_request("c", 7, max_tokens=3)
    for r in (a, b, c):
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [
        ("a", [0, 1]),
        ("b", [2, 3]),
        ("c", [4, 5]),
    ]
    assert kv.num_free_blocks == 0 and c.output_token_ids == [token_at(7)]

    # a and b each need a third block: c is preempted, its blocks freed tail first.
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"c"}
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[5], [4]]
    assert c.status == RequestStatus.PREEMPTED
    assert (c.num_computed_tokens, c.num_preemptions) == (0, 1)
    assert c.output_token_ids == [token_at(7)]
    assert kv.get_block_ids("c") == []
    assert list(sched.waiting) == [c] and sched.running == [a, b]

    # A later arrival queues behind the preempted request; the pool is still full.
    sched.add_request(make_request("d", 3, max_tokens=1))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.finished_req_ids == set()
    assert outs[0].finish_reason == "length"  # a is done: blocks 5, 1, 0 come back

    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert so.num_scheduled_tokens == {"b": 1, "c": 8, "d": 3}
    resumed, fresh = so.scheduled_new_reqs
    assert (resumed.req_id, resumed.prompt_token_ids, resumed.output_token_ids) == (
        "c",
        list(range(1, 8)),
        [token_at(7)],
    )
    assert (resumed.block_ids, resumed.num_computed_tokens) == ([5, 1], 0)
    assert (fresh.req_id, fresh.block_ids) == ("d", [0])
    assert c.output_token_ids == [token_at(7), token_at(8)]

    results = run_to_completion(sched, runner)
    assert c.output_token_ids == [token_at(p) for p in range(7, 10)]
    assert results["b"].new_token_ids == [token_at(12), token_at(13)]
    assert b.output_token_ids == [token_at(p) for p in range(8, 14)]
    assert kv.num_free_blocks == 6


def test_a_request_that_is_itself_the_last_is_preempted_and_the_pass_stops():
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    runner = FakeRunner(kv)
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 8, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    so, _ = step(sched, runner)  # a fits in its 2 blocks; b needs a third and is last
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    assert so.scheduled_new_reqs == []  # nothing is admitted in a step that preempted
    assert b.status == RequestStatus.PREEMPTED
    assert kv.block_pool.free_block_ids() == [3, 2]

    so, outs = step(sched, runner)  # a takes block 3; b (9 tokens, 3 blocks) cannot return
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]
    assert outs == [EngineCoreOutput("a", [token_at(9)], finish_reason="length")]

    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"a"}
    assert [(n.req_id, n.block_ids, n.output_token_ids) for n in so.scheduled_new_reqs] == [
        ("b", [2, 3, 1], [token_at(8)])
    ]
    run_to_completion(sched, runner)
    assert b.output_token_ids == [token_at(8), token_at(9)]
    assert kv.num_free_blocks == 4


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lpm"])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_random_workload_under_pressure_completes_with_batching_independent_tokens(
        seed, caching, policy):
    # Every prompt is 1, 2, 3, ... and the fake model samples token_at(position), so with
    # caching every request shares blocks with the others and with its own past.
    rng = random.Random(seed)
    sched, kv = make_scheduler(
        num_blocks=12,
        block_size=4,
        max_num_seqs=5,
        budget=rng.choice([3, 8, 32]),
        max_model_len=40,
        caching=caching,
        policy=policy,
    )
    runner = FakeRunner(kv)
    requests = {}
    for i in range(30):
        priority = rng.randint(-2, 2) if policy == "priority" else 0
        req = make_request(f"r{i}", rng.randint(1, 30), max_tokens=rng.randint(1, 20),
                           priority=priority)
        requests[req.request_id] = req
    pending = list(requests.values())
    results: dict[str, list[int]] = {r: [] for r in requests}
    for _ in range(2000):
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        so, outs = step(sched, runner)
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= 5
        for out in outs:
            results[out.req_id] += out.new_token_ids
        held = [b for r in sched.running for b in kv.get_block_ids(r.request_id)]
        assert len(set(held)) + kv.num_free_blocks == 12
        assert all(kv.block_pool.ref_count(b) == held.count(b) for b in held)
    assert not pending and sched.get_num_unfinished_requests() == 0
    assert kv.num_free_blocks == 12
    assert any(r.num_preemptions for r in requests.values())
    assert (kv.prefix_cache_hits > 0) == caching
    for req_id, req in requests.items():
        n = req.num_prompt_tokens
        expected_len = min(req.max_tokens, 40 - n)
        assert results[req_id] == [token_at(p) for p in range(n, n + expected_len)]
        assert req.finish_reason == "length"


# ---- aborts ----------------------------------------------------------------------------


def test_abort_frees_blocks_and_reports_the_ids_next_step():
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    runner = FakeRunner(kv)
    a, b = make_request("a", 6), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    assert kv.get_block_ids("a") == [0, 1] and sched.num_waiting == 1
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert kv.num_free_blocks == 8 and kv.block_pool.free_block_ids()[-2:] == [1, 0]
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.num_scheduled_tokens == {}
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already gone: ignored
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_drops_the_step_result():
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    runner = FakeRunner(kv)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    so = sched.schedule()
    result = runner.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, result)
    assert [o.req_id for o in outs] == ["b"]
    assert kv.get_block_ids("a") == [] and kv.num_free_blocks == 6


# ---- finish rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "script, kwargs, expected, reason, stop_reason",
    [
        # a stop token id ends it; the token is part of the output
        ([5, 7, 9], dict(stop_token_ids=[7]), [5, 7], "stop", 7),
        # an EOS token ends it with no stop_reason
        ([5, 2, 9], dict(eos=[2]), [5, 2], "stop", None),
        ([2, 2, 2], dict(eos=[2], ignore_eos=True, max_tokens=3), [2, 2, 2], "length", None),
        # min_tokens: stop ids and EOS count only once the output has that many tokens
        ([2, 2, 5], dict(eos=[2], min_tokens=2), [2, 2], "stop", None),
        ([7, 7, 7, 7], dict(stop_token_ids=[7], min_tokens=3), [7, 7, 7], "stop", 7),
        ([5, 6, 8, 9, 10], dict(max_tokens=4), [5, 6, 8, 9], "length", None),
        # a stop token that is also the last allowed token is a stop
        ([5, 7], dict(stop_token_ids=[7], max_tokens=2), [5, 7], "stop", 7),
        ([5, 2], dict(eos=[2], max_tokens=2), [5, 2], "stop", None),
        # stop ids are checked before EOS and are not affected by ignore_eos
        ([2], dict(eos=[2], stop_token_ids=[2], ignore_eos=True), [2], "stop", 2),
    ],
)
def test_finish_rules(script, kwargs, expected, reason, stop_reason):
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    runner = FakeRunner(kv, script={"a": script})
    req = make_request("a", 5, **{"max_tokens": 16, **kwargs})
    sched.add_request(req)
    results = run_to_completion(sched, runner)
    assert results["a"] == EngineCoreOutput("a", expected, reason, stop_reason)
    assert (req.output_token_ids, req.finish_reason, req.stop_reason) == (
        expected,
        reason,
        stop_reason,
    )
    expected_status = {
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH,
    }
    assert req.status == expected_status[reason]
    assert kv.num_free_blocks == 8


def test_max_model_len_ends_a_request_with_length():
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)
    runner = FakeRunner(kv)
    req = make_request("a", 10, max_tokens=100)
    sched.add_request(req)
    results = run_to_completion(sched, runner)
    assert results["a"] == EngineCoreOutput("a", [token_at(10), token_at(11)], "length")
    assert req.num_tokens == 12 and kv.num_free_blocks == 4


# ---- refusals --------------------------------------------------------------------------


def test_add_request_refuses_a_prompt_at_max_model_len_and_duplicate_ids():
    sched, _ = make_scheduler(num_blocks=4, block_size=4, max_model_len=12)
    with pytest.raises(ValueError, match="12 tokens, at or past max_model_len=12"):
        sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 11))
    with pytest.raises(ValueError, match="'b' is already in use"):
        sched.add_request(make_request("b", 3))
    assert sched.get_num_unfinished_requests() == 1


def test_scheduler_refuses_a_pool_smaller_than_one_sequence():
    kv = KVCacheManager(block_pool_size=3, block_size=4)
    with pytest.raises(ValueError, match="holds 3 blocks of 4 tokens, fewer than the 4"):
        Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        Scheduler(kv, max_num_seqs=0, max_num_batched_tokens=16, max_model_len=8)


def test_request_refuses_bad_construction():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        make_request("a", 3, max_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        make_request("a", 0)
