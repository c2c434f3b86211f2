"""Automatic prefix caching: block hashes, hits, eviction and reset, with exact block ids."""

from __future__ import annotations

import pytest
from scheduler_utils import FakeRunner, make_scheduler, run_to_completion, step, token_at

from vllmpy.core.block_pool import BlockPool, hash_block_tokens
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request
from vllmpy.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(), set(), 16, 0.0, cache_salt=cache_salt)


def compute(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """Allocate a request from its cache hit, mark ``num_tokens`` (default: all) computed
    and enter its full blocks into the cache, as the scheduler and runner would."""
    hit_blocks, num_hit = kv.get_computed_blocks(req)
    num_tokens = req.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate_slots(req, num_tokens - num_hit, hit_blocks) is not None
    req.num_computed_tokens = num_tokens
    kv.cache_blocks(req)
    return kv.get_block_ids(req.request_id)


# ---- the hash chain ----------------------------------------------------------------------


def test_block_hashes_chain_each_block_to_everything_before_it():
    kv = KVCacheManager(8, 4)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    a = make_request("a", tokens)
    compute(kv, a)
    assert len(a.block_hashes) == 3  # the partial block has no hash
    for i, h in enumerate(a.block_hashes):
        parent = a.block_hashes[i - 1] if i else None
        assert h == hash_block_tokens(parent, tokens[4 * i:4 * i + 4])
    assert len(set(a.block_hashes)) == 3

    # a change in block 1 changes the hash of block 1 and of every block after it
    b = make_request("b", tokens[:5] + [7] + tokens[6:])
    compute(kv, b)
    assert b.block_hashes[0] == a.block_hashes[0]
    assert all(x != y for x, y in zip(b.block_hashes[1:], a.block_hashes[1:]))
    # the same block contents after a different prefix is a different block
    assert hash_block_tokens(b.block_hashes[0], tokens[8:12]) != a.block_hashes[2]


def test_a_cache_salt_separates_otherwise_equal_prompts():
    kv = KVCacheManager(16, 4)
    tokens = list(range(12))
    plain = make_request("plain", tokens)
    compute(kv, plain)
    salted = make_request("salted", tokens, cache_salt="tenant-1")
    assert kv.get_computed_blocks(salted) == ([], 0)
    compute(kv, salted)
    assert all(x != y for x, y in zip(salted.block_hashes, plain.block_hashes))
    same_salt = make_request("same", tokens + [99], cache_salt="tenant-1")
    assert kv.get_computed_blocks(same_salt) == (kv.get_block_ids("salted"), 12)
    other_salt = make_request("other", tokens + [99], cache_salt="tenant-2")
    assert kv.get_computed_blocks(other_salt) == ([], 0)


# ---- hits ----------------------------------------------------------------------------


def test_a_shared_prefix_is_served_from_the_cached_blocks():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(10)))
    assert compute(kv, a) == [0, 1, 2]
    # b shares a's first 8 tokens (two full blocks), then differs
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert (hit_blocks, num_hit) == ([0, 1], 8)
    assert [kv.block_pool.ref_count(i) for i in (0, 1)] == [1, 1]  # a lookup takes nothing
    assert kv.allocate_slots(b, 5, hit_blocks) == [3, 4]
    assert kv.get_block_ids("b") == [0, 1, 3, 4]
    assert [kv.block_pool.ref_count(i) for i in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 1]
    assert kv.num_free_blocks == 5


def test_the_partial_last_block_is_never_shared_and_the_last_token_is_always_computed():
    kv = KVCacheManager(10, 4)
    a = make_request("a", list(range(10)))
    compute(kv, a)  # blocks 0, 1 full and cached; block 2 holds tokens 8, 9 only
    assert kv.get_computed_blocks(make_request("b", list(range(10)))) == ([0, 1], 8)
    assert kv.get_computed_blocks(make_request("c", list(range(12)))) == ([0, 1], 8)

    d = make_request("d", list(range(12)))
    assert compute(kv, d)[2] != 2  # d filled its own third block
    # all three of d's blocks are cached, but a 12-token prompt keeps its last block to
    # compute (the hit stops before the last token); a 13-token one gets all three
    assert kv.get_computed_blocks(make_request("e", list(range(12))))[1] == 8
    assert kv.get_computed_blocks(make_request("f", list(range(13))))[1] == 12
    assert kv.get_computed_blocks(make_request("g", list(range(4))))[1] == 0


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(8, 4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([], 0)
    a.num_computed_tokens = 6  # a prefill chunk: only block 0 is full and computed
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([0], 4)
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(make_request("b", list(range(13)))) == ([0, 1, 2], 12)


def test_two_requests_computing_the_same_block_keep_the_first_copy():
    kv = KVCacheManager(8, 4)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert kv.allocate_slots(a, 9) == [0, 1, 2]
    assert kv.allocate_slots(b, 9) == [3, 4, 5]  # neither is computed yet: no hit
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_blocks(r)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)
    assert kv.block_pool.block_hash(3) is None and kv.block_pool.block_hash(4) is None
    kv.free(a)
    kv.free(b)
    assert kv.get_computed_blocks(make_request("c", list(range(9)))) == ([0, 1], 8)


# ---- freeing, eviction, reset ---------------------------------------------------------


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(6, 2)
    a = make_request("a", [1, 2, 3, 4, 5])  # blocks [0, 1, 2]; 0 and 1 full
    b = make_request("b", [7, 8, 9])  # blocks [3, 4]; 3 full
    assert compute(kv, a) == [0, 1, 2]
    assert compute(kv, b) == [3, 4]
    kv.free(a)
    kv.free(b)
    # tail first within a request, requests in the order they ended
    assert kv.block_pool.free_block_ids() == [5, 2, 1, 0, 4, 3]
    assert kv.block_pool.num_cached_blocks == 3
    assert kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 5])) == ([0, 1], 4)

    # new allocations take from the front: 5 and 2 held no cached prefix, 1 did
    c = make_request("c", [20, 21, 22, 23, 24, 25])
    assert kv.allocate_slots(c, 6) == [5, 2, 1]
    assert kv.get_computed_blocks(make_request("a3", [1, 2, 3, 4, 5])) == ([0], 2)
    assert kv.get_computed_blocks(make_request("b2", [7, 8, 9])) == ([3], 2)
    assert kv.block_pool.num_evictions == 1

    # reusing block 0 moves it to the back of the queue when it is freed again
    d = make_request("d", [1, 2, 3])
    assert compute(kv, d) == [0, 4]
    assert kv.block_pool.free_block_ids() == [3]
    kv.free(d)
    assert kv.block_pool.free_block_ids() == [3, 4, 0]
    assert kv.allocate_slots(make_request("e", [0, 0]), 2) == [3]  # evicts b's block
    assert kv.get_computed_blocks(make_request("b3", [7, 8, 9])) == ([], 0)
    assert kv.get_computed_blocks(make_request("a4", [1, 2, 3, 4, 5])) == ([0], 2)


def test_reviving_free_cached_blocks_counts_against_the_free_blocks():
    kv = KVCacheManager(4, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    assert compute(kv, a) == [0, 1, 2]
    kv.free(a)  # free queue: [3, 2, 1, 0]; 0 and 1 cached
    b = make_request("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert (hit_blocks, num_hit) == ([0, 1], 4)
    # 2 revived + 3 new > 4 free: refused, nothing taken
    assert kv.allocate_slots(b, 5, hit_blocks) is None
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 0]
    # 2 revived + 2 new fit exactly; the revived blocks leave the middle of the queue
    assert kv.allocate_slots(b, 4, hit_blocks) == [3, 2]
    assert kv.get_block_ids("b") == [0, 1, 3, 2]
    assert kv.num_free_blocks == 0


def test_reset_is_refused_while_blocks_are_in_use_and_then_forgets_everything():
    kv = KVCacheManager(6, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))[1] == 4  # untouched
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])) == ([], 0)
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 2, 1, 0]  # the queue is kept
    # the pool caches again after a reset
    assert compute(kv, make_request("d", [1, 2, 3])) == [3, 4]
    assert kv.get_computed_blocks(make_request("e", [1, 2, 3]))[1] == 2


def test_block_pool_cache_refusals():
    pool = BlockPool(2)
    h = hash_block_tokens(None, [1, 2])
    with pytest.raises(ValueError, match="KV block 0 is cached but not in use"):
        pool.cache_block(0, h)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.cache_block(0, h) is True
    assert pool.cache_block(0, h) is True  # the same again is a no-op
    assert pool.cache_block(1, h) is False  # another block already holds h
    with pytest.raises(ValueError, match="already cached under another hash"):
        pool.cache_block(0, hash_block_tokens(None, [3, 4]))


def test_without_caching_nothing_is_hashed_or_found():
    kv = KVCacheManager(8, 4, enable_caching=False)
    a = make_request("a", list(range(12)))
    compute(kv, a)
    kv.free(a)
    b = make_request("b", list(range(13)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert a.block_hashes == [] and b.block_hashes == []
    assert kv.block_pool.num_cached_blocks == 0
    kv.record_prefix_lookup(b, 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    assert kv.reset_prefix_cache() is True


# ---- the scheduler with caching --------------------------------------------------------


def test_scheduler_starts_a_request_after_its_cached_prefix():
    sched, kv = make_scheduler(num_blocks=16, block_size=4, caching=True)
    runner = FakeRunner(kv)
    sched.add_request(Request("a", list(range(1, 11)), SamplingParams(), set(), 2, 0.0))
    run_to_completion(sched, runner)
    # a computed tokens 1..10 and its first output: blocks [0, 1] full, [2] partial
    b = Request("b", list(range(1, 9)) + [77, 78, 79], SamplingParams(), set(), 1, 0.0)
    sched.add_request(b)
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.req_id, new.block_ids[:2], new.num_computed_tokens) == ("b", [0, 1], 8)
    assert so.num_scheduled_tokens == {"b": 3}
    assert outs[0].num_cached_tokens == 8 and b.num_cached_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    sched, kv = make_scheduler(num_blocks=7, block_size=4, max_model_len=24, caching=True)
    runner = FakeRunner(kv)
    a = Request("a", [9] * 8, SamplingParams(), set(), 4, 0.0)
    b = Request("b", [5] * 8, SamplingParams(), set(), 4, 0.0)
    c = Request("c", [3] * 7, SamplingParams(), set(), 6, 0.0)
    for r in (a, b, c):
        sched.add_request(r)
    so, _ = step(sched, runner)
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[0, 1], [2, 3], [4, 5]]
    # a takes the last free block for its third; b needs one too: c is preempted
    so, _ = step(sched, runner)
    assert so.finished_req_ids == {"c"} and c.num_preemptions == 1
    assert so.scheduled_cached_reqs.new_block_ids == [[6], [5]]
    # c's block 4 (tokens 3, 3, 3, 3) stays cached in the free queue while c waits for
    # room (reviving it and one new block needs two free blocks)
    assert kv.block_pool.free_block_ids() == [4]
    resumed = None
    while resumed is None:
        so, _ = step(sched, runner)
        resumed = next((n for n in so.scheduled_new_reqs if n.req_id == "c"), None)
    assert so.finished_req_ids == {"a", "b"}
    assert (resumed.block_ids[0], resumed.num_computed_tokens) == (4, 4)
    assert so.num_scheduled_tokens["c"] == 8 - 4  # 7 prompt tokens + 1 output, 4 cached
    run_to_completion(sched, runner)
    assert c.output_token_ids == [token_at(p) for p in range(7, 13)]
    assert c.num_cached_tokens == 0  # what it had cached when first admitted
    # the stats count a request's first admission only, as vLLM's do
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (8 + 8 + 7, 0)
    assert kv.num_free_blocks == 7
