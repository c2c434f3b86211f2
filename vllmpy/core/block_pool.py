"""The pool of KV cache blocks: ids, reference counts and the free queue."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Hands out and takes back the ``num_blocks`` KV blocks, ids ``0 .. num_blocks-1``.

    Contract:

    - Every block has a reference count: the number of requests using it. A block with a
      count of 0 is in the free queue, and only those are.
    - The free queue is FIFO. At start it holds the ids in ascending order, so the first
      allocations get the lowest ids. ``get_new_blocks`` takes from the front;
      ``free_blocks`` appends the blocks whose count drops to 0 at the back, in the order
      given. A block freed earlier is therefore reused earlier. Callers free a request's
      blocks tail first, so that when prefix caching arrives the tail blocks (the least
      likely to be shared) are the first to be evicted.
    - ``touch`` takes extra references on blocks, pulling them out of the free queue if
      they were in it.

    Prefix caching will add a block-hash -> block map here: ``free_blocks`` keeps a freed
    block's hash (the block stays reusable until evicted), ``touch`` revives a cached block
    from the middle of the free queue (hence an ordered map rather than a deque), and
    ``get_new_blocks`` drops the hash of each block it hands out (the eviction, least
    recently freed first). None of these signatures change.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        # Insertion-ordered set of free block ids: front = next to hand out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, front first (for tests and debugging)."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with count 1.

        Raises ValueError, taking nothing, if fewer than ``num_blocks`` are free.
        """
        if num_blocks > len(self._free):
            raise ValueError(
                f"cannot allocate {num_blocks} KV blocks: only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; those reaching 0 join the back of the queue,
        in the order given."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] <= 0:
                raise ValueError(f"KV block {block_id} is freed but not in use")
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking a free one out of the free queue."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1
