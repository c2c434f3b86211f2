"""Logprobs: what a request asked to see of the distribution at a position, on the device.

One batched pass over the logits rows that need it, then one small copy to the host:

    values = each row in its request's ``logprobs_mode``: log_softmax of (raw logits, or
             the processed logits the sampler drew from), or those logits themselves
    top    = values.topk(largest k of the batch)       -- the most likely alternatives
    token  = values.gather(scored token id)            -- the sampled token, or the prompt
                                                          token that followed the position
    rank   = (values > token value).sum() + 1          -- 1-based over the whole vocabulary;
                                                          tied tokens share a rank

A request that lists ``logprob_token_ids`` gets those ids' values (and their ranks over the
whole vocabulary) in place of the top alternatives.

The runner uses ``sampled_logprobs`` at its sampling point and ``PromptLogprobsPlan`` for
the prompt positions of a prefill chunk; both end in ``LogprobsLists`` (plain lists).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllmpy.core.sched_output import LogprobsLists
from vllmpy.sampling_params import LOGPROBS_MODES, SamplingParams

# Rows of prompt positions whose logits are computed at once (bounds the logits memory:
# rows x vocab_size float32).
PROMPT_LOGITS_ROWS = 256
# Elements of the [rows, ids, vocab] comparison that ranks explicit ids, per slice.
_RANK_SLICE_ELEMENTS = 1 << 26


def wants_logprobs(params: SamplingParams) -> bool:
    """True when a request reports logprobs for its generated tokens."""
    return params.logprobs is not None or bool(params.logprob_token_ids)


@dataclass
class LogprobsSpec:
    """What each row of a logits batch reports; one entry per row in every list."""

    # Alternatives reported besides the scored token (-1 already resolved to vocab_size).
    num_top: list[int]
    modes: list[str]  # one of LOGPROBS_MODES
    # Ids reported in place of the alternatives; an empty list means "the top ones".
    token_ids: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.num_top)
        if len(self.modes) != n or len(self.token_ids) != n:
            raise ValueError(f"LogprobsSpec lists differ in length: {n} num_top, "
                             f"{len(self.modes)} modes, {len(self.token_ids)} token_ids")
        bad = sorted(set(self.modes) - set(LOGPROBS_MODES))
        if bad:
            raise ValueError(f"unknown logprobs modes {bad}; known: {LOGPROBS_MODES}")

    @property
    def num_rows(self) -> int:
        return len(self.num_top)

    def width(self, row: int) -> int:
        """Entries of ``row`` besides the scored token."""
        ids = self.token_ids[row]
        return len(ids) if ids else self.num_top[row]

    @classmethod
    def for_sampled(cls, params: Sequence[SamplingParams], vocab_size: int) -> LogprobsSpec:
        """Rows of generated tokens: each request's logprobs, mode and listed ids. Listed
        ids outside the vocabulary are dropped (the frontend refuses them)."""
        return cls(
            num_top=[_resolve(p.logprobs or 0, vocab_size) for p in params],
            modes=[p.logprobs_mode for p in params],
            token_ids=[[t for t in p.logprob_token_ids or () if 0 <= t < vocab_size]
                       for p in params],
        )

    @classmethod
    def for_prompt(cls, num_top: Sequence[int], vocab_size: int) -> LogprobsSpec:
        """Rows of prompt positions: raw log-probabilities and the top ``num_top``."""
        return cls(num_top=[_resolve(k, vocab_size) for k in num_top],
                   modes=["raw_logprobs"] * len(num_top), token_ids=[[] for _ in num_top])


def _resolve(num_top: int, vocab_size: int) -> int:
    return vocab_size if num_top == -1 else min(num_top, vocab_size)


@dataclass
class LogprobsTensors:
    """The device results for ``num_rows`` positions; column 0 is the scored token."""

    token_ids: torch.Tensor  # [num_rows, 1 + width] int64
    logprobs: torch.Tensor  # [num_rows, 1 + width] float32
    ranks: torch.Tensor  # [num_rows, 1 + width] int64

    def to_lists(self, spec: LogprobsSpec, start: int = 0) -> LogprobsLists:
        """Copy to the host, each row cut to its own width. ``start`` is the position of
        row 0 (see LogprobsLists)."""
        ids, values, ranks = (t.tolist() for t in (self.token_ids, self.logprobs, self.ranks))
        widths = [1 + spec.width(r) for r in range(spec.num_rows)]
        return LogprobsLists([row[:w] for row, w in zip(ids, widths)],
                             [row[:w] for row, w in zip(values, widths)],
                             [row[:w] for row, w in zip(ranks, widths)], start)


def logprobs_values(raw_logits: torch.Tensor, processed_logits: torch.Tensor | None,
                    modes: Sequence[str]) -> torch.Tensor:
    """[num_rows, vocab] float32: each row as its mode reports it.

    ``raw_logits`` are the model's logits (any float dtype); ``processed_logits`` the
    sampler's float32 logits of the distribution it drew from, needed only when some
    mode is ``processed_*``.
    """
    processed_rows = [m.startswith("processed") for m in modes]
    logprob_rows = [m.endswith("logprobs") for m in modes]
    values = raw_logits.float()
    if any(processed_rows):
        if processed_logits is None:
            raise ValueError("a processed logprobs mode needs the sampler's processed logits")
        values = _by_row(processed_rows, processed_logits.float(), values)
    if any(logprob_rows):
        values = _by_row(logprob_rows, values.log_softmax(dim=-1), values)
    return values


def _by_row(mask: list[bool], when_true: torch.Tensor, otherwise: torch.Tensor) -> torch.Tensor:
    if all(mask):
        return when_true
    rows = torch.tensor(mask, dtype=torch.bool, device=otherwise.device).unsqueeze(1)
    return torch.where(rows, when_true, otherwise)


def count_greater(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[num_rows, n] int64: for each target, the entries of its row strictly greater."""
    out = torch.empty(targets.shape, dtype=torch.int64, device=values.device)
    per_row = max(1, targets.shape[1] * values.shape[1])
    step = max(1, _RANK_SLICE_ELEMENTS // per_row)
    for lo in range(0, values.shape[0], step):
        hi = lo + step
        # [rows, n, vocab] comparison, summed over the vocabulary
        out[lo:hi] = (values[lo:hi].unsqueeze(1) > targets[lo:hi].unsqueeze(2)).sum(dim=-1)
    return out


def gather_logprobs(values: torch.Tensor, token_ids: torch.Tensor,
                    spec: LogprobsSpec) -> LogprobsTensors:
    """The scored token (``token_ids``, [num_rows] int64), its rank, and each row's top
    alternatives or listed ids, from ``values`` ([num_rows, vocab] float32)."""
    if values.dim() != 2 or values.shape[0] != spec.num_rows or token_ids.shape != (
            spec.num_rows,):
        raise ValueError(f"values {tuple(values.shape)} and token ids "
                         f"{tuple(token_ids.shape)} do not match {spec.num_rows} rows")
    device = values.device
    token_ids = token_ids.to(torch.int64).unsqueeze(1)  # [num_rows, 1]
    token_values = values.gather(1, token_ids)
    token_ranks = (values > token_values).sum(dim=-1, keepdim=True) + 1
    max_top = max((spec.num_top[r] for r in range(spec.num_rows) if not spec.token_ids[r]),
                  default=0)
    max_listed = max((len(ids) for ids in spec.token_ids), default=0)
    width = max(max_top, max_listed)
    ids = torch.zeros((spec.num_rows, width), dtype=torch.int64, device=device)
    vals = torch.full((spec.num_rows, width), float("-inf"), device=device)
    ranks = torch.zeros((spec.num_rows, width), dtype=torch.int64, device=device)
    if max_top:
        top_vals, top_ids = values.topk(max_top, dim=-1)  # descending
        # Entries strictly greater than a top value are all among the top ones, so its
        # rank is its first position among them: a search in the ascending negation.
        negated = top_vals.neg().contiguous()
        top_ranks = torch.searchsorted(negated, negated) + 1
        ids[:, :max_top], vals[:, :max_top], ranks[:, :max_top] = top_ids, top_vals, top_ranks
    if max_listed:
        listed_rows = [r for r in range(spec.num_rows) if spec.token_ids[r]]
        padded = [spec.token_ids[r] + [0] * (max_listed - len(spec.token_ids[r]))
                  for r in listed_rows]
        rows = torch.tensor(listed_rows, dtype=torch.int64, device=device)
        listed = torch.tensor(padded, dtype=torch.int64, device=device)  # [rows, max_listed]
        row_values = values.index_select(0, rows)
        listed_vals = row_values.gather(1, listed)
        listed_ranks = count_greater(row_values, listed_vals) + 1
        pad = width - max_listed
        ids[rows] = torch.nn.functional.pad(listed, (0, pad))
        vals[rows] = torch.nn.functional.pad(listed_vals, (0, pad), value=float("-inf"))
        ranks[rows] = torch.nn.functional.pad(listed_ranks, (0, pad))
    return LogprobsTensors(torch.cat([token_ids, ids], dim=1),
                           torch.cat([token_values, vals], dim=1),
                           torch.cat([token_ranks, ranks], dim=1))


# ---- the runner's two entry points ------------------------------------------------------


@dataclass
class SampledLogprobs:
    """Device results for the sampled rows that asked, until the step copies them back."""

    rows: list[int]  # indices into the step's sampled rows
    num_sampled: int
    spec: LogprobsSpec
    tensors: LogprobsTensors

    def to_lists(self) -> list[LogprobsLists | None]:
        """One entry per sampled row: its logprobs (one position), or None."""
        out: list[LogprobsLists | None] = [None] * self.num_sampled
        lists = self.tensors.to_lists(self.spec)
        for i, row in enumerate(self.rows):
            out[row] = LogprobsLists([lists.token_ids[i]], [lists.logprobs[i]],
                                     [lists.ranks[i]])
        return out


def sampled_logprobs(params: Sequence[SamplingParams], logits: torch.Tensor,
                     processed_logits: torch.Tensor | None,
                     sampled: torch.Tensor) -> SampledLogprobs | None:
    """Logprobs of the sampled tokens for the rows whose request asked; None when none.

    ``params[i]`` is the request of logits row ``i``; ``logits`` are what the sampler was
    given, ``processed_logits`` what it drew from, ``sampled`` ([num_rows]) what it drew.
    Stays on the device.
    """
    rows = [i for i, p in enumerate(params) if wants_logprobs(p)]
    if not rows:
        return None
    spec = LogprobsSpec.for_sampled([params[i] for i in rows], logits.shape[1])
    index = None if len(rows) == len(params) else torch.tensor(rows, device=logits.device)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if index is None else t.index_select(0, index)

    values = logprobs_values(pick(logits), None if processed_logits is None
                             else pick(processed_logits), spec.modes)
    return SampledLogprobs(rows, len(params), spec,
                           gather_logprobs(values, pick(sampled), spec))


@dataclass
class PromptChunk:
    """One request's prefill chunk as the runner laid it out in the step."""

    req_id: str
    prompt_token_ids: Sequence[int]
    num_prompt_logprobs: int  # the request's prompt_logprobs (-1: the whole vocabulary)
    start: int  # first position the chunk computes
    end: int  # one past its last position
    first_row: int  # the flat token row of position ``start`` in the step's hidden states


@dataclass
class PromptLogprobsPlan:
    """The prompt positions a step scores: position p's logits score prompt token p + 1.

    Built on the host from the chunks of the requests that asked; ``run`` computes the
    logits of just those rows, a slice at a time, and returns each request's rows.
    """

    hidden_rows: list[int]
    target_ids: list[int]
    num_top: list[int]
    # (req_id, index of its first scored prompt token, number of rows), in row order
    spans: list[tuple[str, int, int]]

    @classmethod
    def build(cls, chunks: Sequence[PromptChunk]) -> PromptLogprobsPlan | None:
        plan = cls([], [], [], [])
        for c in chunks:
            last = min(c.end, len(c.prompt_token_ids) - 1)  # the final prompt token scores none
            if last <= c.start:
                continue
            plan.hidden_rows.extend(range(c.first_row, c.first_row + last - c.start))
            plan.target_ids.extend(c.prompt_token_ids[c.start + 1:last + 1])
            plan.num_top.extend([c.num_prompt_logprobs] * (last - c.start))
            plan.spans.append((c.req_id, c.start + 1, last - c.start))
        return plan if plan.spans else None

    def run(self, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
            vocab_size: int) -> dict[str, LogprobsLists]:
        """``hidden``: the step's [num_tokens, hidden_size] states; ``compute_logits``
        maps rows of it to [rows, vocab] logits."""
        device = hidden.device
        spec = LogprobsSpec.for_prompt(self.num_top, vocab_size)
        parts: list[LogprobsTensors] = []
        for lo in range(0, len(self.hidden_rows), PROMPT_LOGITS_ROWS):
            hi = lo + PROMPT_LOGITS_ROWS
            rows = torch.tensor(self.hidden_rows[lo:hi], dtype=torch.int64, device=device)
            targets = torch.tensor(self.target_ids[lo:hi], dtype=torch.int64, device=device)
            sub = LogprobsSpec(spec.num_top[lo:hi], spec.modes[lo:hi], spec.token_ids[lo:hi])
            logits = compute_logits(hidden.index_select(0, rows))
            parts.append(_pad_width(gather_logprobs(logprobs_values(logits, None, sub.modes),
                                                    targets, sub), 1 + max(spec.num_top)))
        lists = LogprobsTensors(*(torch.cat([getattr(p, f) for p in parts])
                                  for f in ("token_ids", "logprobs", "ranks"))).to_lists(spec)
        out: dict[str, LogprobsLists] = {}
        row = 0
        for req_id, first, count in self.spans:
            out[req_id] = LogprobsLists(lists.token_ids[row:row + count],
                                        lists.logprobs[row:row + count],
                                        lists.ranks[row:row + count], first)
            row += count
        return out


def _pad_width(t: LogprobsTensors, width: int) -> LogprobsTensors:
    """Right-pad every tensor to ``width`` columns so slices concatenate."""
    pad = width - t.token_ids.shape[1]
    if pad <= 0:
        return t
    f = torch.nn.functional.pad
    return LogprobsTensors(f(t.token_ids, (0, pad)), f(t.logprobs, (0, pad), value=float("-inf")),
                           f(t.ranks, (0, pad)))
