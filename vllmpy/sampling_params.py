"""Sampling parameters for text generation, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (vLLM's ``SamplingParams``).

    ``max_tokens`` None or <= 0 means "unset": the engine resolves it to
    max_model_len - prompt length, capped by ``VT_SERVER_MAX_NEW_TOKENS`` if set.
    Invalid values raise ``ValueError`` naming the field.
    """

    n: int = 1  # number of completions returned for the prompt
    presence_penalty: float = 0.0  # subtracted once from the logit of every generated token
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output (CTRL rule)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus cutoff in (0, 1]
    top_k: int = 0  # 0 (or -1) means the whole vocabulary
    min_p: float = 0.0  # drop tokens whose probability < min_p * max probability
    seed: int | None = None  # per-request RNG seed: the same seed gives the same tokens
    stop: str | list[str] | None = None  # stop strings, not included in the output
    stop_token_ids: list[int] | None = None  # token ids that end the completion
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    max_tokens: int | None = 16  # most tokens to generate
    min_tokens: int = 0  # stop ids and EOS are masked until this many tokens exist
    logprobs: int | None = None  # later: number of log-probabilities per output token
    prompt_logprobs: int | None = None  # later: log-probabilities per prompt token
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # added to the logits of those token ids
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine: the stop strings as a list (never None after __post_init__).
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        elif self.stop is None:
            self._stop_list = []
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def _verify(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer")
        if self.max_tokens is not None and not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "an integer")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if (self.max_tokens is not None and self.max_tokens > 0
                and self.min_tokens > self.max_tokens):
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        assert self.stop_token_ids is not None
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported yet")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported yet")

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
