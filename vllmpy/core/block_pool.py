"""The pool of KV cache blocks: ids, reference counts, the free queue and the prefix cache."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

# A block's identity for the prefix cache: a SHA-256 digest chained over every token of
# the sequence up to the end of the block (and the request's extra keys). 256 bits make a
# collision, which would silently serve another prompt's KV, practically impossible.
BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple[Hashable, ...] = ()) -> BlockHash:
    """The hash of one full block: its parent's hash (None for the first block), its
    token ids, and the extra keys that must also match for the KV to be reusable (such as
    a request's cache salt). Equal inputs give equal hashes in every process."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class BlockPool:
    """Hands out and takes back the ``num_blocks`` KV blocks, ids ``0 .. num_blocks-1``,
    and remembers which full blocks hold which cached prefix.

    Contract:

    - Every block has a reference count: the number of requests using it. A block with a
      count of 0 is in the free queue, and only those are.
    - The free queue is FIFO. At start it holds the ids in ascending order, so the first
      allocations get the lowest ids. ``get_new_blocks`` takes from the front;
      ``free_blocks`` appends the blocks whose count drops to 0 at the back, in the order
      given. A block freed earlier is therefore reused earlier. Callers free a request's
      blocks tail first, so the tail blocks (the least likely to be shared) are evicted
      first.
    - ``touch`` takes extra references on blocks, pulling them out of the free queue if
      they were in it.
    - Prefix cache: ``cache_block`` records that a full block holds the KV of a given
      block hash. A cached block keeps its hash when freed, so ``get_cached_block`` can
      find it and ``touch`` can revive it from the middle of the free queue, until
      ``get_new_blocks`` hands it out again: that drops its hash (eviction, least
      recently freed first). One hash maps to at most one block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        # Insertion-ordered set of free block ids: front = next to hand out.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self.num_evictions = 0  # cached blocks handed out again since start-up

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]. Free cached blocks count as free."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, front first (for tests and debugging)."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with count 1,
        evicting the cached prefix each of them held.

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
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; those reaching 0 join the back of the queue,
        in the order given, keeping their cached hash."""
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

    # ---- the prefix cache -----------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``'s KV, in use or free; None if none does."""
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that the in-use, full block ``block_id`` holds ``block_hash``'s KV.

        Returns False, recording nothing, when another block already holds that hash (two
        requests computed the same block at once: the first stays the cached copy).
        """
        if self._ref_cnt[block_id] <= 0:
            raise ValueError(f"KV block {block_id} is cached but not in use")
        holder = self._hash_to_block.get(block_hash)
        if holder is not None:
            return holder == block_id
        if self._block_hash[block_id] is not None:
            raise ValueError(f"KV block {block_id} is already cached under another hash")
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        return True

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False, nothing changed) while any block is
        in use, since a running request may be extending a cached prefix."""
        if len(self._free) != self.num_blocks:
            return False
        self._hash_to_block.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hash[block_id] = None
            self.num_evictions += 1
