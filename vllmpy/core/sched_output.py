"""Plain-data descriptions of one engine step, passed between scheduler, runner and core.

None of these hold tensors: the scheduler describes the step, the model runner turns the
description into device inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllmpy.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen before (or is seeing again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; empty for a fresh request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # every KV block of the request, in order
    num_computed_tokens: int  # tokens whose KV is already in the cache (0 without caching)
    pooling_params: Any = None  # a pooling request's PoolingParams; None to generate


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since their last step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)
    # Tokens the scheduler appended to a request's output since its last step without
    # the runner sampling them (grammar jump-forward); empty lists otherwise.
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What one step computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens computed for it this step (a prefill chunk or 1 for decode)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that left since the last step (finished, aborted or preempted): the runner
    # drops them from its batch. A preempted request comes back later as a NewRequestData.
    finished_req_ids: set[str]
    # Structured output: req_id -> its row of grammar_bitmask, for the requests that sample
    # this step under a grammar. grammar_bitmask is int32 [rows, ceil(vocab_size / 32)]:
    # bit j of word w allows token 32 * w + j. None when no request needs one.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: req_id -> the draft tokens it verifies this step (they follow
    # its known tokens and are counted in num_scheduled_tokens); only requests with drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Set by Scheduler.on_launched when the engine launched this step before the previous
    # one's results were in (async scheduling): its computed tokens are counted already.
    launched_ahead: bool = False


@dataclass
class LogprobsLists:
    """Logprobs of consecutive positions of one request, as plain lists.

    Row i is one position: ``token_ids[i][0]`` is the token scored there (the sampled
    token, or the prompt token that followed), then the top alternatives (or the ids the
    request listed); ``logprobs[i]`` and ``ranks[i]`` line up with it. Ranks are 1-based
    over the whole vocabulary (tokens whose value is strictly greater, plus one).
    ``start`` is the position of row 0: the index of a prompt token for prompt logprobs,
    0 for generated tokens.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[list[int]]
    start: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> LogprobsLists:
        """The first ``n`` rows."""
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.ranks[:n],
                             self.start)


@dataclass
class ModelRunnerOutput:
    """What the runner produced for one step, one entry per scheduled request."""

    req_ids: list[str]
    # One list per request: the sampled token(s); empty when the request is still in the
    # middle of its prefill (a chunk that does not reach the end of the known tokens).
    sampled_token_ids: list[list[int]]
    # Aligned with req_ids: the logprobs of the sampled token(s), None for a request that
    # did not ask. An empty list when no request of the step asked.
    logprobs: list[LogprobsLists | None] = field(default_factory=list)
    # req_id -> logprobs of the prompt tokens this step's chunk scored (only requests
    # that asked for prompt_logprobs).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: aligned with req_ids, the drafts proposed for each request's
    # next step (empty lists for none); empty when nothing was proposed.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # A pooling step: req_id -> its pooled output (float32)
    pooled: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """A per-request delta returned by EngineCore.step()."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0
    # Wall time (time.time()) the request was first scheduled; set on its first output
    # only, so the frontend can tell the time it spent queued.
    first_scheduled_time: float | None = None
    # Why the engine failed the request (finish_reason "error"); None otherwise.
    error: str | None = None
    # One row per new token, for a request that asked for logprobs.
    new_logprobs: LogprobsLists | None = None
    # Prompt logprobs scored by this step's prefill chunk (an output may carry them
    # before the request has a token), for a request that asked for prompt_logprobs.
    new_prompt_logprobs: LogprobsLists | None = None
    # A pooling request's output (it finishes with it): float32 values, little-endian,
    # of the array of shape pooled_shape.
    pooled_data: bytes | None = None
    pooled_shape: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The scheduler's gauges after one step (what the server's metrics report)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # waiting and preempted
    kv_cache_usage: float = 0.0  # fraction of the KV pool in use, in [0, 1]
    num_preemptions_total: int = 0  # since start-up
    num_scheduled_tokens: int = 0  # tokens computed by this step (0 for a stats-only update)
    # Prefix-cache lookups since start-up, in tokens: tokens of newly admitted requests,
    # and how many of them were served from the cache.
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # Speculative decoding since start-up (None when it is off).
    spec_decoding: SpecDecodingStats | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counters since start-up (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify steps of a request that carried at least one draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    # accepted drafts by their position in the draft (index 0: the first draft token)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verify step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts per draft (vLLM's figure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))


@dataclass
class EngineCoreOutputs:
    """What the engine core sends the frontend after a step (or after aborts, so the
    gauges stay current): the per-request deltas, the scheduler's stats and when."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # wall time (time.time()) the step ended
