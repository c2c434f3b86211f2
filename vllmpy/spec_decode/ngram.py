"""``ngram``: prompt lookup. The drafts are the tokens that followed the earliest earlier
occurrence of the sequence's own suffix.

Among the suffixes of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens that occur
earlier in the sequence (prompt and output), the longest wins; among the occurrences of
that suffix, the earliest one (vLLM's rule: its matcher keeps the leftmost position when
two match equally long). An occurrence may overlap the suffix but may not be the suffix
itself. The drafts are up to k tokens after it, fewer when it lies near the end.

No forward pass and no Python loop over positions: per request, one numpy comparison of
every candidate end (a position holding the last token) against the reversed suffix
gives the length of the match ending there, and the first longest one is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vllmpy.spec_decode import Proposer
from vllmpy.spec_decode.config import SpeculativeConfig


class NgramProposer(Proposer):
    """Prompt-lookup drafts: at most ``num_speculative_tokens`` per request, from suffixes
    of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min "
                             f"({prompt_lookup_min}), got {prompt_lookup_max}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, token_ids: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """The drafts for one sequence.

        Args:
            token_ids: 1-D ints, the whole sequence so far (prompt and output).
            max_drafts: a cap below ``num_speculative_tokens``; ``None`` for none.

        Returns:
            The tokens that followed the earliest occurrence of the longest suffix (within
            the bounds) that occurred before: at most ``min(k, max_drafts)`` of them,
            fewer when the sequence ends first; ``[]`` when no suffix recurs.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        seq = np.asarray(token_ids)
        length = seq.shape[0]
        # An occurrence needs at least one token before the suffix's start.
        width = min(self.max_n, length - 1)
        if k <= 0 or width < self.min_n:
            return []
        # Where an earlier occurrence can end: before the last position, on the last token.
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        if ends.size == 0:
            return []
        back = np.arange(width)
        # Row i, column j: does the token j places before ends[i] equal the one j places
        # before the last? Positions before the start of the sequence never match.
        pos = ends[:, None] - back
        same = (pos >= 0) & (seq[np.maximum(pos, 0)] == seq[length - 1 - back])
        match_len = np.logical_and.accumulate(same, axis=1).sum(axis=1)
        best = int(np.argmax(match_len))  # the first of the longest: the earliest occurrence
        if match_len[best] < self.min_n:
            return []
        start = int(ends[best]) + 1
        return seq[start:start + k].tolist()

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        """The drafts of each row in ``rows`` of the runner's token table.

        Args:
            token_ids: 2-D ints ``[max_reqs, max_len]``; row ``r`` holds ``num_tokens[r]``
                valid tokens.
            num_tokens: the valid length of every row.
            rows: the rows to propose for.
            max_drafts: the cap of each entry of ``rows`` (0 gives ``[]``).
        """
        return [self.propose_one(token_ids[r, :int(num_tokens[r])], int(m))
                for r, m in zip(rows, max_drafts)]


def make(config: SpeculativeConfig, runner: Any) -> NgramProposer:
    """The proposer of an ``ngram`` config; it needs nothing from the runner."""
    assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                         config.prompt_lookup_max)
