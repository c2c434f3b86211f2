"""Per-request KV block allocation on top of the BlockPool, with automatic prefix caching."""

from __future__ import annotations

from collections.abc import Sequence

from vllmpy.core.block_pool import BlockHash, BlockPool, hash_block_tokens
from vllmpy.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Keeps, for every request that holds KV memory, its list of blocks in token order.

    Token ``i`` of a request lives in block ``blocks[i // block_size]`` at offset
    ``i % block_size``. A request holds exactly ``ceil(n / block_size)`` blocks, where
    ``n`` is the number of tokens it has been given slots for.

    Prefix caching (``enable_caching``): every full block of a request's tokens has a hash
    chained from its parent's (``Request.block_hashes``). Once a block's tokens are computed
    (``cache_blocks``) the pool maps its hash to it, and it stays findable after its request
    ends until the pool hands it out again. A new request starts with the longest run of
    cached blocks matching its tokens (``get_computed_blocks``), shared by reference.
    Without caching nothing is hashed and nothing is looked up.
    """

    def __init__(self, block_pool_size: int, block_size: int,
                 enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(block_pool_size)
        self._req_to_blocks: dict[str, list[int]] = {}
        # How many leading blocks of each request are known to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache lookups of admitted requests, in tokens, since start-up (vLLM counts
        # only a request's first admission, not its returns after preemption).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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

    # ---- the prefix cache -----------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks that starts the request's tokens: (their ids,
        the number of tokens they hold). Changes no reference count.

        The hit never covers the last token (its logits must be computed to sample), so
        with every block cached it is the prompt's full blocks but the one holding the
        last token. Always ([], 0) without caching, for a request holding blocks, and for
        one that asks for prompt_logprobs (every prompt position must be computed to score
        it, as vLLM's skip_reading_prefix_cache has it).
        """
        if (not self.enable_caching or request.request_id in self._req_to_blocks
                or request.sampling_params.prompt_logprobs is not None
                or request.pooling_params is not None):  # pooling reads every position
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for i in range(max_blocks):
            block_id = self.block_pool.get_cached_block(self._block_hash(request, i))
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup in the prefix-cache stats (in tokens)."""
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_blocks(self, request: Request) -> None:
        """Enter into the prefix cache every full block among the request's first
        ``num_computed_tokens`` tokens (those whose KV the runner has written)."""
        if not self.enable_caching:
            return
        blocks = self._req_to_blocks.get(request.request_id)
        if not blocks:
            return
        # (with async scheduling the computed count may run ahead of the known tokens)
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(known // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], self._block_hash(request, i))
        if num_full > start:
            self._num_cached_blocks[request.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def _block_hash(self, request: Request, index: int) -> BlockHash:
        """The hash of the request's full block ``index``, computing missing ones in order."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            if (i + 1) * size > len(tokens):
                raise ValueError(f"block {i} of request {request.request_id!r} is not full")
            parent = hashes[i - 1] if i else None
            extra = request.hash_extra_keys if i == 0 else ()
            hashes.append(hash_block_tokens(parent, tokens[i * size:(i + 1) * size], extra))
        return hashes[index]

    # ---- allocation -----------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = (),
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Make room for ``request.num_computed_tokens + num_new_tokens`` tokens, counting
        ``computed_blocks`` (a prefix-cache hit from ``get_computed_blocks``, given only
        for a request that holds no blocks yet) as the request's first tokens, and for
        ``num_lookahead_tokens`` past them (where a draft model writes its drafts' KV).

        Returns the ids of the blocks newly taken from the free queue (possibly none), or
        None, allocating nothing, if the pool does not have enough free blocks.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                             f"({num_lookahead_tokens}) must be >= 0")
        blocks = self._req_to_blocks.get(request.request_id, [])
        if computed_blocks and blocks:
            raise ValueError(f"request {request.request_id!r} already holds KV blocks; "
                             f"cached blocks are only given to a request that holds none")
        num_computed = max(request.num_computed_tokens,
                           len(computed_blocks) * self.block_size)
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens,
                          self.block_size)
        num_missing = num_needed - len(blocks) - len(computed_blocks)
        # Reviving a free cached block takes it out of the free queue too.
        num_revived = sum(1 for b in computed_blocks if self.block_pool.ref_count(b) == 0)
        if max(num_missing, 0) + num_revived > self.block_pool.num_free_blocks:
            return None
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            blocks = list(computed_blocks)
            self._req_to_blocks[request.request_id] = blocks
            self._num_cached_blocks[request.request_id] = len(computed_blocks)
        if num_missing <= 0:
            return []
        new_block_ids = self.block_pool.get_new_blocks(num_missing)
        self._req_to_blocks.setdefault(request.request_id, blocks).extend(new_block_ids)
        return new_block_ids

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (a copy; empty if it holds none)."""
        return list(self._req_to_blocks.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Give back every block of the request, tail block first. A no-op if it has none.
        Its cached blocks stay findable until the pool hands them out again."""
        self._num_cached_blocks.pop(request.request_id, None)
        blocks = self._req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
