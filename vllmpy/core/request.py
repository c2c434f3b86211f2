"""Engine-side state of one request: its tokens, its progress and how it ended."""

from __future__ import annotations

import enum
from typing import Any

from vllmpy.core.block_pool import BlockHash
from vllmpy.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()  # queued, never scheduled
    WAITING_FOR_FSM = enum.auto()  # queued while its structured-output grammar compiles
    RUNNING = enum.auto()  # holds KV blocks and a seat in the batch
    PREEMPTED = enum.auto()  # lost its blocks; queued again to recompute prompt + output
    FINISHED_STOPPED = enum.auto()  # a stop token id or an EOS token
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()  # the client went away or the frontend saw a stop string

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One request as the scheduler sees it.

    ``max_tokens`` is already resolved by the frontend (>= 1); ``eos_token_ids`` are the
    model's end-of-sequence ids. Tokens whose KV is in the cache are the first
    ``num_computed_tokens`` of ``all_token_ids``; the rest still have to be computed.
    ``priority`` orders requests under the priority policy (lower first); ``cache_salt``
    keeps the request from sharing cached KV with requests that carry another salt.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        max_tokens: int,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: Any = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must have at least one token")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # A pooling request (a pooling.params.PoolingParams): scheduled whole, computed in
        # one step, finished there with its pooled output; None for a generate request.
        self.pooling_params = pooling_params

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens sampled by a launched step whose results are not in yet (async
        # scheduling): their positions are computed next step from the device's copy.
        self.num_pending_outputs = 0
        self.num_preemptions = 0
        # Speculative decoding: draft tokens proposed after its last step, verified (and
        # computed) with its next one; never part of all_token_ids.
        self.spec_token_ids: list[int] = []
        # The stop token id that ended the request (None for EOS, length or abort).
        self.stop_reason: int | str | None = None
        # Prefix-cache hashes of the full blocks of all_token_ids, in order; extended by
        # the KVCacheManager as blocks fill (tokens never change, so neither do they).
        self.block_hashes: list[BlockHash] = []
        # Prompt tokens served from the prefix cache when first scheduled (None before).
        self.num_cached_tokens: int | None = None
        # The grammar state of a structured-output request (a StructuredOutputRequest,
        # set by the engine core); None for an unconstrained one.
        self.structured_output_request: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. The caller must not modify the list."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def hash_extra_keys(self) -> tuple[str, ...]:
        """What besides the tokens must match for this request to reuse a cached block;
        it goes into the first block's hash, and the chain carries it to the rest."""
        return () if self.cache_salt is None else (f"salt:{self.cache_salt}",)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """ "stop", "length" or "abort" once finished; None while the request lives."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
