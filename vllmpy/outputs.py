"""What the library hands back: vLLM's RequestOutput, CompletionOutput and Logprob, and
for pooling requests PoolingRequestOutput and its task views (embedding, classification,
score)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """The log-probability of one token at one position (vLLM's ``Logprob``).

    ``logprob`` is in the request's logprobs_mode (a logit under the ``*_logits`` modes);
    ``rank`` is 1-based over the whole vocabulary (tokens with a strictly greater value,
    plus one); ``decoded_token`` is the token's text alone, None without a tokenizer.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob; the sampled token comes first, then
# the top alternatives (or the ids the request listed) by rank.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing precedes it), then dicts as above
# with the prompt token first.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt (there are ``n`` per request).

    ``logprobs`` and ``cumulative_logprob`` (the sum of the sampled tokens' values) are
    None unless the request asked for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timing of one request as the frontend saw it (wall times from time.time()).

    Token times are the engine core's step timestamps. ``inter_token_latencies`` holds the
    intervals between steps that produced tokens, observed since the previous
    RequestOutput of this request (so a streaming consumer sees each interval once).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # across all n completions
    inter_token_latencies: list[float] = field(default_factory=list)

    def observe_step(self, first_scheduled_time: float | None, num_new_tokens: int,
                     now: float, first_in_step: bool) -> None:
        """Fold in one core output of a step ending at ``now``. Only the first output of
        a request in a step (``first_in_step``) counts a token interval, so ``n`` child
        completions do not multiply them."""
        if first_scheduled_time is not None and (
                self.first_scheduled_time is None
                or first_scheduled_time < self.first_scheduled_time):
            self.first_scheduled_time = first_scheduled_time
        if not num_new_tokens:
            return
        self.num_generation_tokens += num_new_tokens
        if first_in_step:
            if self.last_token_time is None:
                self.first_token_time = now
            else:
                self.inter_token_latencies.append(now - self.last_token_time)
            self.last_token_time = now


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them
    metrics: RequestMetrics | None = None  # filled by AsyncLLM and LLM


@dataclass
class FinishedRequestStats:
    """One request at its end, however it ended (a metrics logger's view of it)."""

    finish_reason: str  # "stop", "length", "abort" or "error"
    metrics: RequestMetrics  # its timing and token counts at the end
    n: int  # completions asked for
    max_tokens: int  # per completion, as resolved by the engine


@dataclass
class IterationStats:
    """What one batch of engine-core outputs did, as the frontend saw it: tokens counted
    as they arrive, not when their request ends."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # of the requests whose first token came in this batch
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class PoolingOutput:
    """A pooling request's output: ``data`` is a float32 tensor (one vector, or one row per
    token for the encode task)."""

    data: Any  # torch.Tensor


@dataclass
class PoolingRequestOutput:
    """vLLM's ``PoolingRequestOutput``: one per prompt of an encode/embed/classify/score
    call."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label (after softmax / sigmoid unless the request said not)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
