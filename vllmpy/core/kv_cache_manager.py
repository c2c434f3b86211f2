"""Per-request KV block allocation on top of the BlockPool."""

from __future__ import annotations

from vllmpy.core.block_pool import BlockPool
from vllmpy.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Keeps, for every request that holds KV memory, its list of blocks in token order.

    Token ``i`` of a request lives in block ``blocks[i // block_size]`` at offset
    ``i % block_size``. A request holds exactly ``ceil(n / block_size)`` blocks, where
    ``n`` is the number of tokens it has been given slots for.
    """

    def __init__(self, block_pool_size: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(block_pool_size)
        self._req_to_blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, in [0, 1]."""
        return self.block_pool.get_usage()

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``request.num_computed_tokens + num_new_tokens`` tokens.

        Returns the ids of the blocks added (possibly none), or None, allocating nothing,
        if the pool does not have enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks = self._req_to_blocks.get(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_missing = num_needed - len(blocks)
        if num_missing <= 0:
            return []
        if num_missing > self.block_pool.num_free_blocks:
            return None
        new_block_ids = self.block_pool.get_new_blocks(num_missing)
        self._req_to_blocks.setdefault(request.request_id, blocks).extend(new_block_ids)
        return new_block_ids

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (a copy; empty if it holds none)."""
        return list(self._req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail block first. A no-op if it has none."""
        blocks = self._req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
