"""SamplingMetadata: the sampling parameters of one step's requests, batched on the device.

Row ``i`` of every tensor belongs to the request whose logits are row ``i`` of the logits
the ``Sampler`` receives. A parameter that no request in the batch uses is stored as
``None``, so the sampler skips its work entirely: a batch of plain greedy requests costs one
argmax. The ``no_*`` and ``all_*`` flags name those fast paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from vllmpy.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5  # temperature below this is greedy decoding, as in vLLM

T = TypeVar("T", int, float)


@dataclass
class SamplingMetadata:
    """Device-ready sampling parameters for ``num_reqs`` requests (one logits row each).

    Build it with ``SamplingMetadata.build``; the sampler never reads ``SamplingParams``.
    """

    num_reqs: int
    vocab_size: int
    # True when every request is greedy (temperature < 1e-5) / when none is.
    all_greedy: bool
    all_random: bool
    # [num_reqs] bool, True on greedy rows; None when the batch is all greedy or all random.
    greedy_mask: torch.Tensor | None
    # [num_reqs] float32; greedy rows hold 1.0 so that dividing by it is harmless.
    # None when every request is greedy.
    temperature: torch.Tensor | None
    # [num_reqs] int64 in [1, vocab_size]; vocab_size where top-k is off. None when no
    # random request uses top-k. max_top_k is the largest k of the rows that use it,
    # known on the host so the sampler need not read it back.
    top_k: torch.Tensor | None
    max_top_k: int
    # [num_reqs] float32 in (0, 1]; 1.0 where top-p is off. None when no random request uses it.
    top_p: torch.Tensor | None
    # [num_reqs] float32 in [0, 1]; 0.0 where min-p is off. None when no random request uses it.
    min_p: torch.Tensor | None
    # row -> the request's own RNG (seeded requests); other random rows use the global RNG.
    generators: dict[int, torch.Generator]
    # [num_reqs] float32 penalties, each None when no request uses it (1.0 / 0.0 / 0.0).
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    # [num_reqs, max_len] int64 token ids right-padded with vocab_size. The prompt ids are
    # kept only when a repetition penalty is set, the output ids when any penalty is.
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    # Sparse logit bias: (rows, token ids) and the values added there. None when unused.
    logit_bias_index: tuple[torch.Tensor, torch.Tensor] | None
    logit_bias_values: torch.Tensor | None
    # (rows, token ids) set to -inf because the request has fewer than min_tokens outputs:
    # its stop_token_ids and EOS ids. None when no request is under its min_tokens.
    min_tokens_index: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def no_penalties(self) -> bool:
        return (self.repetition_penalties is None and self.frequency_penalties is None
                and self.presence_penalties is None)

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_logit_bias(self) -> bool:
        return self.logit_bias_index is None

    @property
    def no_min_tokens(self) -> bool:
        return self.min_tokens_index is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[set[int]],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Batch the parameters of ``len(params)`` requests; every list has one entry each.

        ``output_token_ids`` are the tokens each request generated so far (they drive the
        penalties and min_tokens). A generator is used only for a random (non-greedy) row
        and must live on ``device``. Raises ``ValueError`` for mismatched lengths, a
        generator on another device, or a logit_bias token id outside the vocabulary.
        """
        n = len(params)
        for name, seq in (("prompt_token_ids", prompt_token_ids),
                          ("output_token_ids", output_token_ids),
                          ("generators", generators), ("eos_token_ids", eos_token_ids)):
            if len(seq) != n:
                raise ValueError(f"{name} has {len(seq)} entries for {n} requests")
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        random_rows = [i for i in range(n) if not greedy[i]]
        all_greedy, all_random = not random_rows, len(random_rows) == n

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # top-k, top-p and min-p only matter on random rows; greedy rows hold "off".
        top_k_list = _random_rows(
            [min(p.top_k, vocab_size) or vocab_size for p in params], greedy, vocab_size)
        top_p_list = _random_rows([p.top_p for p in params], greedy, 1.0)
        min_p_list = _random_rows([p.min_p for p in params], greedy, 0.0)
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        use_rep = any(v != 1.0 for v in rep)
        use_output = use_rep or any(freq) or any(pres)
        bias_index, bias_values = _logit_bias(params, vocab_size, device)
        return cls(
            num_reqs=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=(None if all_greedy or all_random
                         else torch.tensor(greedy, dtype=torch.bool, device=device)),
            temperature=(None if all_greedy
                         else floats([1.0 if g else p.temperature
                                      for g, p in zip(greedy, params)])),
            top_k=(None if top_k_list is None
                   else torch.tensor(top_k_list, dtype=torch.int64, device=device)),
            max_top_k=max((k for k in top_k_list or () if k < vocab_size), default=vocab_size),
            top_p=None if top_p_list is None else floats(top_p_list),
            min_p=None if min_p_list is None else floats(min_p_list),
            generators=_generators(generators, random_rows, device),
            repetition_penalties=floats(rep) if use_rep else None,
            frequency_penalties=floats(freq) if any(freq) else None,
            presence_penalties=floats(pres) if any(pres) else None,
            prompt_token_ids=(_pad(prompt_token_ids, vocab_size, device) if use_rep
                              else None),
            output_token_ids=(_pad(output_token_ids, vocab_size, device) if use_output
                              else None),
            logit_bias_index=bias_index,
            logit_bias_values=bias_values,
            min_tokens_index=_min_tokens(params, output_token_ids, eos_token_ids,
                                         vocab_size, device),
        )


def _random_rows(values: list[T], greedy: list[bool], off: T) -> list[T] | None:
    """``values`` with ``off`` on greedy rows, or None when every row is ``off``."""
    out = [off if g else v for v, g in zip(values, greedy)]
    return None if all(v == off for v in out) else out


def _generators(generators: Sequence[torch.Generator | None], random_rows: list[int],
                device: torch.device) -> dict[int, torch.Generator]:
    out: dict[int, torch.Generator] = {}
    for i in random_rows:
        g = generators[i]
        if g is None:
            continue
        if g.device.type != device.type:
            raise ValueError(
                f"generator of request {i} is on {g.device}, the batch is on {device}")
        out[i] = g
    return out


def _pad(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64, right-padded with ``pad`` (at least one column)."""
    width = max((len(r) for r in rows), default=0) or 1
    padded = [list(r) + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def _logit_bias(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device,
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        bad = sorted(t for t in p.logit_bias if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary "
                             f"(size {vocab_size})")
        for token_id, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if not rows:
        return None, None
    index = (torch.tensor(rows, dtype=torch.int64, device=device),
             torch.tensor(cols, dtype=torch.int64, device=device))
    return index, torch.tensor(values, dtype=torch.float32, device=device)


def _min_tokens(
    params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[set[int]], vocab_size: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    # As in vLLM, the EOS ids are masked too when ignore_eos is set: min_tokens counts
    # against every id that could end a request.
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or ()) | set(eos_token_ids[i])
        # An id past the logits cannot be sampled, so there is nothing to mask.
        masked = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        rows.extend([i] * len(masked))
        cols.extend(masked)
    if not rows:
        return None
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device))
