"""The scheduler's side of speculative decoding: drafts scheduled after the known tokens,
lookahead slots, the rollback of rejected drafts, and drafts cut to what may be emitted."""

from __future__ import annotations

from scheduler_utils import make_request

from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.sched_output import ModelRunnerOutput
from vllmpy.core.scheduler import Scheduler


def make(lookahead=2, max_model_len=64):
    kv = KVCacheManager(16, 4, enable_caching=True)
    return Scheduler(kv, 4, 64, max_model_len, speculative=True,
                     num_lookahead_tokens=lookahead), kv


def run(sched, sampled, drafts):
    so = sched.schedule()
    out = ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled,
                            spec_token_ids=drafts)
    return so, sched.update_from_output(so, out)


def test_drafts_are_verified_and_rejected_ones_rolled_back():
    sched, kv = make()
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    so, _ = run(sched, [[100]], [[101, 102, 103]])
    assert so.num_scheduled_tokens == {"a": 6}
    assert len(kv.get_block_ids("a")) == 2  # 6 tokens + 2 lookahead slots
    assert req.spec_token_ids == [101, 102, 103]

    so, outs = run(sched, [[101, 55]], [[]])  # first draft accepted, then the target's own
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [101, 102, 103]}
    assert len(kv.get_block_ids("a")) == 3  # 6 + 4 tokens + 2 lookahead slots
    assert outs[0].new_token_ids == [101, 55]
    assert req.all_token_ids[6:] == [100, 101, 55]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    stats = sched.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])
    assert stats.mean_acceptance_length == 2.0
    # Only blocks of accepted tokens are in the prefix cache: the first two.
    assert len(req.block_hashes) == 2
    assert req.spec_token_ids == []
    so, _ = run(sched, [[56]], [[]])
    assert so.num_scheduled_tokens == {"a": 1} and not so.scheduled_spec_decode_tokens


def test_drafts_are_cut_to_max_tokens_and_max_model_len():
    sched, _ = make(max_model_len=12)
    req = make_request("a", 6, max_tokens=4)
    sched.add_request(req)
    run(sched, [[100]], [[1, 2, 3, 4]])
    so, _ = run(sched, [[1, 2, 3]], [[9, 9, 9]])  # 1 output + 3 may still be emitted
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}
    assert req.is_finished and req.output_token_ids == [100, 1, 2, 3]

    sched, _ = make(max_model_len=10)
    req = make_request("b", 6, max_tokens=20)
    sched.add_request(req)
    run(sched, [[100]], [[1, 2, 3, 4]])
    so, _ = run(sched, [[1, 2, 3]], [[]])  # 7 tokens: 3 more reach max_model_len
    assert so.scheduled_spec_decode_tokens == {"b": [1, 2]}
    assert req.is_finished and req.num_tokens == 10


def test_a_budget_that_cuts_the_step_cuts_the_drafts_first():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(kv, 4, 3, 64, speculative=True)
    req = make_request("a", 2, max_tokens=20)
    sched.add_request(req)
    run(sched, [[100]], [[1, 2, 3, 4]])
    so, _ = run(sched, [[1, 2, 7]], [[]])
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2]}


def test_preemption_drops_the_drafts():
    sched, kv = make()
    req = make_request("a", 6, max_tokens=20)
    sched.add_request(req)
    run(sched, [[100]], [[1, 2]])
    sched._preempt(sched.running.pop())
    assert req.spec_token_ids == [] and req.num_computed_tokens == 0
    so, _ = run(sched, [[1]], [[]])
    assert so.scheduled_new_reqs[0].req_id == "a" and not so.scheduled_spec_decode_tokens
    assert kv.usage > 0
