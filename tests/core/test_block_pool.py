"""BlockPool and KVCacheManager bookkeeping, with exact block ids."""

import pytest

from vllmpy.core.block_pool import BlockPool
from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request
from vllmpy.sampling_params import SamplingParams


def make_request(req_id: str, prompt_len: int) -> Request:
    return Request(req_id, list(range(prompt_len)), SamplingParams(), set(), 16, 0.0)


def test_allocation_hands_out_lowest_ids_first():
    pool = BlockPool(10)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(2) == [3, 4]
    assert pool.num_free_blocks == 5
    assert pool.free_block_ids() == [5, 6, 7, 8, 9]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.get_usage() == pytest.approx(0.5)


def test_freed_blocks_join_the_back_of_the_queue_in_the_order_given():
    pool = BlockPool(6)
    assert pool.get_new_blocks(4) == [0, 1, 2, 3]
    pool.free_blocks([3, 1])
    assert pool.free_block_ids() == [4, 5, 3, 1]
    pool.free_blocks([0])
    assert pool.free_block_ids() == [4, 5, 3, 1, 0]
    # Reuse is FIFO: never-used blocks first, then blocks in the order they were freed.
    assert pool.get_new_blocks(3) == [4, 5, 3]
    assert pool.get_new_blocks(2) == [1, 0]
    assert pool.num_free_blocks == 0


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="cannot allocate 2 KV blocks: only 1 of 4"):
        pool.get_new_blocks(2)
    assert pool.free_block_ids() == [3]


def test_ref_counts_and_touch():
    pool = BlockPool(4)
    assert pool.get_new_blocks(2) == [0, 1]
    pool.touch([1])  # a second user of block 1
    assert pool.ref_count(1) == 2
    pool.free_blocks([1, 0])
    assert pool.ref_count(1) == 1
    assert pool.free_block_ids() == [2, 3, 0]
    # Touching a free block takes it out of the middle of the queue.
    pool.touch([3])
    assert pool.free_block_ids() == [2, 0]
    pool.free_blocks([1, 3])
    assert pool.free_block_ids() == [2, 0, 1, 3]
    with pytest.raises(ValueError, match="KV block 2 is freed but not in use"):
        pool.free_blocks([2])


def test_kv_manager_grows_across_a_block_boundary_by_exactly_one_block():
    kv = KVCacheManager(block_pool_size=8, block_size=4)
    req = make_request("a", 10)
    assert kv.allocate_slots(req, 10) == [0, 1, 2]  # 10 tokens -> 3 blocks
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 1) == []  # 11th token fits in block 2
    req.num_computed_tokens = 11
    assert kv.allocate_slots(req, 1) == []  # 12th token fills block 2
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1) == [3]  # 13th token opens block 3
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4
    assert kv.usage == pytest.approx(0.5)


def test_kv_manager_refuses_without_allocating_anything():
    kv = KVCacheManager(block_pool_size=4, block_size=4)
    a, b = make_request("a", 8), make_request("b", 12)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 12) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 2
    assert kv.allocate_slots(b, 8) == [2, 3]


def test_kv_manager_frees_a_request_tail_block_first():
    kv = KVCacheManager(block_pool_size=6, block_size=2)
    a, b = make_request("a", 5), make_request("b", 2)
    assert kv.allocate_slots(a, 5) == [0, 1, 2]
    assert kv.allocate_slots(b, 2) == [3]
    kv.free(a)
    assert kv.block_pool.free_block_ids() == [4, 5, 2, 1, 0]
    assert kv.get_block_ids("a") == []
    kv.free(a)  # a second free is a no-op
    kv.free(b)
    assert kv.num_free_blocks == 6
    assert kv.usage == 0.0
    c = make_request("c", 7)
    assert kv.allocate_slots(c, 7) == [4, 5, 2, 1]
