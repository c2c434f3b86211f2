"""Prompt lookup against a plain double loop: the longest suffix (within the bounds) that
occurred before, its most recent occurrence, and the tokens after it."""

from __future__ import annotations

import numpy as np
import pytest

from vllmpy.spec_decode.ngram import NgramProposer


def reference(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):  # most recent first, never the suffix
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


def test_the_obvious_case():
    p = NgramProposer(3, 1, 3)
    assert p.propose_one(np.array([1, 2, 3, 4, 1, 2, 3])) == [4, 1, 2]
    assert p.propose_one(np.array([1, 2, 3, 4, 1, 2, 3]), max_drafts=1) == [4]
    assert p.propose_one(np.array([5, 6, 7])) == []
    assert p.propose_one(np.array([9])) == []


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "2 3" occurred (followed by 8) and "1 2 3" occurred earlier (followed by 4).
    seq = np.array([1, 2, 3, 4, 9, 2, 3, 8, 0, 1, 2, 3])
    assert NgramProposer(2, 1, 3).propose_one(seq) == [4, 9]
    assert NgramProposer(2, 1, 2).propose_one(seq) == [8, 0]


def test_most_recent_occurrence_and_the_end_of_the_sequence():
    seq = np.array([7, 1, 5, 7, 2, 6, 7])
    assert NgramProposer(4, 1, 1).propose_one(seq) == [2, 6, 7]
    assert NgramProposer(4, 2, 3).propose_one(seq) == []  # no suffix of 2 or 3 recurs


def test_bad_bounds_are_refused_by_name():
    for args, needle in (((0, 1, 2), "num_speculative_tokens"),
                         ((2, 0, 2), "prompt_lookup_min"),
                         ((2, 3, 2), "prompt_lookup_max")):
        with pytest.raises(ValueError, match=needle):
            NgramProposer(*args)


def test_batch_form_equals_the_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    p = NgramProposer(4, 2, 4)
    table = np.zeros((8, 64), dtype=np.int32)
    for _ in range(30):
        lengths = rng.integers(1, 64, size=8)
        for r, n in enumerate(lengths):
            table[r, :n] = rng.integers(0, 4, size=n)
        rows = list(rng.permutation(8)[:5])
        caps = [int(c) for c in rng.integers(0, 5, size=5)]
        got = p.propose(table, lengths, rows, caps)
        want = [reference(table[r, :lengths[r]].tolist(), min(4, c), 2, 4)
                for r, c in zip(rows, caps)]
        assert got == want
    assert any(got)  # the small vocabulary makes matches common
