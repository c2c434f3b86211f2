"""Sampling parameters for text generation, with vLLM's field names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from vllmpy.structured_output.params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# The values SamplingParams.logprobs_mode takes (vLLM's names).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
MAX_LOGPROB_TOKEN_IDS = 128  # the most ids SamplingParams.logprob_token_ids may list


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
    # Log-probabilities of each generated token plus this many most likely alternatives
    # (None: none; -1: the whole vocabulary). CompletionOutput.logprobs carries them.
    logprobs: int | None = None
    # The same for every prompt token after the first (RequestOutput.prompt_logprobs).
    prompt_logprobs: int | None = None
    # At most MAX_LOGPROB_TOKEN_IDS ids whose logprobs each generated position reports in
    # place of the top alternatives (the sampled token is reported too, ranked over the
    # whole vocabulary). Setting logprobs as well is allowed only when it equals their count.
    logprob_token_ids: list[int] | None = None
    # What the reported values are (vLLM's modes): "raw_logprobs" / "raw_logits" come from
    # the model's logits before any processing; "processed_logprobs" / "processed_logits"
    # from the distribution actually sampled (after logit bias, penalties, temperature,
    # min-p, top-k and top-p). Prompt logprobs are always raw log-probabilities.
    logprobs_mode: str = "raw_logprobs"
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # added to the logits of those token ids
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Constrain the output to a JSON schema, regex, choice list or grammar (a dict of the
    # same fields is accepted and converted).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: the stop strings as a list (never None after __post_init__).
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
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
        self._verify_logprobs()

    def _verify_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < -1):
                raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole "
                                 f"vocabulary, got {value!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                             f"got {self.logprobs_mode!r}")
        ids = self.logprob_token_ids
        if ids is None:
            return
        if (not isinstance(ids, list) or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
            raise ValueError(f"logprob_token_ids must be a non-empty list of token ids >= 0, "
                             f"got {ids!r}")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids has {len(ids)} ids; at most "
                             f"{MAX_LOGPROB_TOKEN_IDS} are allowed")
        if self.logprobs is not None and self.logprobs != len(ids):
            raise ValueError(f"logprobs ({self.logprobs}) must be unset or equal to the number "
                             f"of logprob_token_ids ({len(ids)}): the listed ids replace the "
                             f"top alternatives")

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
