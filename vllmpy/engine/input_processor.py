"""Frontend validation and tokenization: a user's prompt -> EngineCoreRequest."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllmpy import envs
from vllmpy.config import ModelConfig
from vllmpy.engine.core import EngineCoreRequest
from vllmpy.engine.output_processor import child_request_id
from vllmpy.pooling.params import PoolingParams
from vllmpy.sampling_params import RequestOutputKind, SamplingParams

# A prompt is text, a list of token ids, or vLLM's dict forms {"prompt": text} and
# {"prompt_token_ids": ids}, either of which may add "cache_salt": str.
PromptType = str | list[int] | dict[str, Any]


@dataclass
class ProcessedPrompt:
    """One prompt, validated and split into its n child requests for the core."""

    prompt: str | None
    prompt_token_ids: list[int]
    child_params: list[SamplingParams]  # one per completion, n=1 each
    core_requests: list[EngineCoreRequest]  # ids from child_request_id(request_id, i, n)


class LogprobsLimitError(ValueError):
    """A request asking for more logprobs than ``--max-logprobs`` allows; ``param`` names
    the sampling field (vLLM's wording and parameter)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_logprobs_limit(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's rule: ``logprobs`` and ``prompt_logprobs`` of at most ``max_logprobs``; -1 on
    either side stands for the whole vocabulary."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for field, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, field)
        if asked == -1:
            asked = vocab_size
        if asked and asked > limit:
            raise LogprobsLimitError(f"Requested {kind} logprobs of {asked}, which is greater "
                                     f"than max allowed: {limit}", field)


def check_cache_salt(salt: Any) -> str | None:
    """A cache salt is None or a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string if provided, got {salt!r}")
    return salt


class RequestTooLongError(ValueError):
    """The prompt and max_tokens together do not fit the serving length."""

    param = "max_tokens"


def check_unicode(text: str, what: str) -> None:
    """Refuse text that holds a lone surrogate (it cannot be encoded, so not tokenized)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 scheduling_policy: str = "fcfs") -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.vocab_size = model_config.text_config.vocab_size
        self.scheduling_policy = scheduling_policy

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); raises ValueError on bad input."""
        if isinstance(prompt, dict):
            keys = set(prompt) - {"cache_salt"}
            if keys == {"prompt"} and isinstance(prompt["prompt"], str):
                return self.tokenize(prompt["prompt"])
            if keys == {"prompt_token_ids"}:
                return self.tokenize(list(prompt["prompt_token_ids"]))
            raise ValueError(f"a prompt dict must be {{'prompt': str}} or "
                             f"{{'prompt_token_ids': list[int]}} (either may add "
                             f"'cache_salt'), got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("no tokenizer is loaded (--skip-tokenizer-init, or a dummy-"
                                 "weight model without tokenizer.json); pass prompt token ids "
                                 "instead of text")
            check_unicode(prompt, "the prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(f"prompt token ids must be integers, got {t!r}")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt token id {t} is out of range for the "
                                     f"vocabulary of {self.vocab_size} tokens")
            return None, ids
        raise ValueError(f"a prompt must be a string or a list of token ids, "
                         f"got {type(prompt).__name__}")

    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """max_tokens None or <= 0 means unset: whatever room the serving length leaves,
        capped by VT_SERVER_MAX_NEW_TOKENS when that is set."""
        room = self.model_config.max_model_len - num_prompt_tokens
        if params.max_tokens is not None and params.max_tokens > 0:
            return params.max_tokens
        cap = envs.VT_SERVER_MAX_NEW_TOKENS
        return min(room, cap) if cap is not None and cap > 0 else room

    def check_priority(self, priority: int) -> None:
        """A non-zero priority needs the priority policy (vLLM refuses it otherwise)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"Got priority {priority} but Priority scheduling is not enabled: this engine "
                f"runs --scheduling-policy {self.scheduling_policy}; start it with "
                f"--scheduling-policy priority, or send priority 0")

    def process(self, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, priority: int = 0,
                cache_salt: str | None = None) -> EngineCoreRequest:
        self.check_priority(priority)
        check_cache_salt(cache_salt)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: it must contain at least one token")
        max_len = self.model_config.max_model_len
        if n >= max_len:
            raise ValueError(f"the prompt is {n} tokens, at or past max_model_len ({max_len}): "
                             f"at most {max_len - 1} prompt tokens leave room to generate")
        if params.max_tokens is not None and params.max_tokens > 0 \
                and n + params.max_tokens > max_len:
            raise RequestTooLongError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n + params.max_tokens} tokens ({n} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                f"prompt or max_tokens (at most {max_len - n} here).")
        for stop in params.stop_strings or ():
            check_unicode(stop, "a stop string")
        if params.stop_strings and (self.tokenizer is None or not params.detokenize):
            raise ValueError("stop strings need detokenized text: this request has no "
                             "tokenizer or detokenize=False; use stop_token_ids instead")
        for t in params.stop_token_ids or []:
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is out of range for the "
                                 f"vocabulary of {self.vocab_size} tokens")
        for t in params.logit_bias or {}:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"logit_bias token id {t} is out of range for the "
                                 f"vocabulary of {self.vocab_size} tokens")
        outside = [t for t in params.logprob_token_ids or () if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"logprob_token_ids {outside} are outside the vocabulary of "
                             f"{self.vocab_size} tokens")
        check_logprobs_limit(params, self.model_config.max_logprobs, self.vocab_size)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            max_tokens=self.resolve_max_tokens(params, n),
            arrival_time=time.time(),
            priority=priority,
            cache_salt=cache_salt,
        )

    def process_prompt(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       prompt_token_ids: list[int] | None = None,
                       priority: int = 0) -> ProcessedPrompt:
        """Validate and tokenize a prompt and split it into ``params.n`` child requests
        (child i seeded with seed + i). Raises ValueError before anything is registered,
        so a refused prompt leaves no trace. ``prompt_token_ids``, when given, are used
        instead of tokenizing ``prompt`` (whose text, if any, is kept for the output).
        A dict prompt's ``cache_salt`` goes to every child."""
        self.check_task("generate")
        salt = check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
        self.check_priority(priority)
        if prompt_token_ids is None:
            text, ids = self.tokenize(prompt)
        else:
            _, ids = self.tokenize(list(prompt_token_ids))
            given = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            text = given if isinstance(given, str) else None
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            children.append(child)
        core_requests = [self.process(child_request_id(request_id, i, params.n), ids, p,
                                      priority, salt)
                         for i, p in enumerate(children)]
        return ProcessedPrompt(text, ids, children, core_requests)

    # ---- pooling requests -----------------------------------------------------------

    def check_task(self, task: str) -> None:
        """A pooling task this engine serves, else a ValueError naming the task and model."""
        from vllmpy.pooling import model_tasks

        tasks = model_tasks(self.model_config)
        name, arch = self.model_config.model, self.model_config.text_config.architectures[0]
        if task == "generate" and "generate" not in tasks:
            raise ValueError(f"the model {name!r} ({arch}) is a pooling model (tasks: "
                             f"{', '.join(tasks)}): it does not generate text")
        if task != "generate" and task not in tasks:
            how = (" (start it with --runner pooling --convert embed to embed with it)"
                   if tasks == ("generate",) else "")
            raise ValueError(f"the model {name!r} ({arch}) does not serve the {task} task; "
                             f"it serves: {', '.join(tasks)}{how}")

    def _pooling_text(self, prompt: PromptType, params: PoolingParams) -> str | None:
        """The text a plain pooling prompt (no pair, no truncation) is tokenized from, its
        checkpoint prompt prepended for ``embed``; None for any other prompt."""
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if (not isinstance(text, str) or self.tokenizer is None
                or params.truncate_prompt_tokens is not None):
            return None
        check_unicode(text, "the input")
        spec = self.model_config.pooling
        if params.task == "embed" and spec is not None and spec.default_prompt:
            text = spec.default_prompt + text
        return text

    def _pooling_ids(self, prompt: PromptType, params: PoolingParams,
                     pair: str | None, ids: list[int] | None = None
                     ) -> tuple[str | None, list[int]]:
        """Token ids of a pooling prompt (a text pair for a cross-encoder), truncated when
        ``truncate_prompt_tokens`` asks, else checked against max_model_len; ``ids``: the
        prompt's ids when the caller tokenized its text already."""
        spec = self.model_config.pooling
        limit = self.model_config.max_model_len
        keep = params.truncate_prompt_tokens
        keep = limit if keep == -1 else keep
        if keep is not None and keep > limit:
            raise ValueError(f"truncate_prompt_tokens {keep} exceeds this model's maximum "
                             f"input length of {limit} tokens")
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if ids is not None:
            text = self._pooling_text(prompt, params)
        elif isinstance(text, str) or pair is not None:
            if self.tokenizer is None:
                raise ValueError("no tokenizer is loaded; pass prompt token ids instead of "
                                 "text")
            if not isinstance(text, str):
                raise ValueError("a text pair needs two texts")
            check_unicode(text, "the input")
            if params.task == "embed" and spec is not None and spec.default_prompt:
                text = spec.default_prompt + text
            backend = self.tokenizer.backend
            if keep is not None:  # the tokenizer's truncation keeps the special tokens
                backend.enable_truncation(keep)
            try:
                if pair is None:
                    ids = backend.encode(text, add_special_tokens=True).ids
                else:
                    check_unicode(pair, "the second text")
                    ids = backend.encode(text, pair, add_special_tokens=True).ids
            finally:
                if keep is not None:
                    backend.no_truncation()
        else:
            text, ids = self.tokenize(prompt)
            if keep is not None:
                ids = ids[:keep]
        if not ids:
            raise ValueError("the input is empty: it must contain at least one token")
        if len(ids) > limit:
            raise RequestTooLongError(
                f"This model's maximum input length is {limit} tokens. However, the input "
                f"is {len(ids)} tokens. Please shorten it, or set truncate_prompt_tokens to "
                f"truncate it.")
        return text if isinstance(text, str) else None, ids

    def _check_dimensions(self, params: PoolingParams) -> None:
        if params.dimensions is None:
            return
        if params.task != "embed":
            raise ValueError(f"dimensions applies to the embed task, not {params.task}")
        cfg = self.model_config.hf_config
        allowed = cfg.get("matryoshka_dimensions")
        if not (cfg.get("is_matryoshka") or allowed):
            raise ValueError(f"Model {self.model_config.model!r} does not support matryoshka "
                             f"representation, changing output dimensions will lead to poor "
                             f"results.")
        if allowed and params.dimensions not in allowed:
            raise ValueError(f"Model {self.model_config.model!r} only supports "
                             f"{sorted(allowed)} matryoshka dimensions, got "
                             f"{params.dimensions}")

    def process_pooling_batch(self, items: Sequence[tuple[str, PromptType, PoolingParams,
                                                           str | None]]
                              ) -> list[ProcessedPrompt]:
        """``process_pooling`` of each (request id, prompt, params, pair), the plain texts
        among them tokenized in one batch (the tokenizer spreads a batch over the cores)."""
        texts = {j: self._pooling_text(prompt, params) if pair is None else None
                 for j, (_, prompt, params, pair) in enumerate(items)}
        batch = [j for j, text in texts.items() if text is not None]
        encoded: dict[int, list[int]] = {}
        if batch:
            assert self.tokenizer is not None
            for j, enc in zip(batch, self.tokenizer.backend.encode_batch(
                    [texts[j] for j in batch], add_special_tokens=True)):
                encoded[j] = enc.ids
        return [self.process_pooling(request_id, prompt, params, pair, ids=encoded.get(j))
                for j, (request_id, prompt, params, pair) in enumerate(items)]

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams,
                        pair: str | None = None, priority: int = 0,
                        ids: list[int] | None = None) -> ProcessedPrompt:
        """Validate and tokenize one pooling prompt (with ``pair``: a cross-encoder's text
        pair) into its one core request; ``ids``: its text's ids, when tokenized already
        (``process_pooling_batch``)."""
        self.check_task(params.task)
        self.check_priority(priority)
        self._check_dimensions(params)
        salt = check_cache_salt(prompt.get("cache_salt")) if isinstance(prompt, dict) else None
        text, ids = self._pooling_ids(prompt, params, pair, ids)
        sampling = SamplingParams(max_tokens=1, detokenize=False)
        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=list(ids),
                                    sampling_params=sampling, max_tokens=1,
                                    arrival_time=time.time(), priority=priority,
                                    cache_salt=salt, pooling_params=params)
        return ProcessedPrompt(text, ids, [sampling], [request])
