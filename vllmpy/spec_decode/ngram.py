"""``ngram``: prompt lookup. The drafts are the tokens that followed the last earlier
occurrence of the sequence's own suffix.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are
looked for earlier in the sequence (prompt and output); the longest n that occurs wins,
and among its occurrences the most recent one (vLLM's rule). The drafts are up to k
tokens after it, fewer when it lies near the end. No forward pass: one numpy comparison
of sliding windows per n and request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vllmpy.spec_decode import Proposer
from vllmpy.spec_decode.config import SpeculativeConfig


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{num_speculative_tokens}")
        if prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({prompt_lookup_max}) must be >= "
                             f"prompt_lookup_min ({prompt_lookup_min})")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, token_ids: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """The drafts for one sequence (1-D ints): at most ``max_drafts`` (default k)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        seq = np.asarray(token_ids)
        length = len(seq)
        if k <= 0 or length < 2:
            return []
        # Windows of the sequence without its last token: they start before the suffix.
        head = seq[:-1]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            matches = np.flatnonzero((sliding_window_view(head, n) == seq[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return [int(t) for t in seq[start:start + k]]
        return []

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(token_ids[r, :int(num_tokens[r])], m)
                for r, m in zip(rows, max_drafts)]


def make(config: SpeculativeConfig, runner: Any) -> NgramProposer:
    assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                         config.prompt_lookup_max)
