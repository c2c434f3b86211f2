"""Prompt lookup: the longest suffix (within the bounds) that occurred before, its earliest
occurrence (vLLM's rule), and the tokens after it; the batch form against a plain double
loop on random sequences."""

from __future__ import annotations

import numpy as np
import pytest

from vllmpy.spec_decode.ngram import NgramProposer


def reference(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest n first, then occurrences from the left; the suffix itself never counts."""
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n):
            if seq[i:i + n] == suffix:
                return seq[i + n:i + n + k]
    return []


def test_the_obvious_case_and_its_truncations():
    seq = np.array([1, 2, 3, 4, 1, 2, 3])
    assert NgramProposer(3, 1, 3).propose_one(seq) == [4, 1, 2]
    assert NgramProposer(3, 1, 3).propose_one(seq, max_drafts=1) == [4]
    assert NgramProposer(3, 1, 3).propose_one(seq, max_drafts=0) == []
    assert NgramProposer(3, 1, 3).propose_one(seq, max_drafts=9) == [4, 1, 2]  # k caps it
    assert NgramProposer(8, 1, 3).propose_one(seq) == [4, 1, 2, 3]  # the sequence ends
    drafts = NgramProposer(3, 1, 3).propose_one(seq.astype(np.int32))
    assert all(type(t) is int for t in drafts)


def test_no_match_gives_nothing():
    p = NgramProposer(3, 1, 3)
    assert p.propose_one(np.array([5, 6, 7])) == []
    assert p.propose_one(np.array([9])) == []
    assert p.propose_one(np.array([], dtype=np.int32)) == []
    # A suffix of 2 would have to occur before itself: there is no room in two tokens.
    assert NgramProposer(3, 2, 3).propose_one(np.array([4, 4])) == []


def test_longest_suffix_wins_over_an_earlier_shorter_one():
    # "2 3" first occurred followed by 8; "1 2 3" occurred later, followed by 4.
    seq = np.array([2, 3, 8, 0, 1, 2, 3, 4, 9, 1, 2, 3])
    assert NgramProposer(2, 1, 3).propose_one(seq) == [4, 9]
    assert NgramProposer(2, 1, 2).propose_one(seq) == [8, 0]


def test_earliest_occurrence_is_taken():
    # 7 occurred twice before the last token: followed by 1 5 and later by 2 6.
    seq = np.array([7, 1, 5, 7, 2, 6, 7])
    assert NgramProposer(4, 1, 1).propose_one(seq) == [1, 5, 7, 2]
    assert NgramProposer(4, 2, 3).propose_one(seq) == []  # no suffix of 2 or 3 recurs


def test_an_occurrence_may_overlap_the_suffix():
    assert NgramProposer(3, 2, 2).propose_one(np.array([1, 1, 1])) == [1]
    assert NgramProposer(3, 1, 4).propose_one(np.array([3, 5, 3, 5, 3])) == [5, 3]


def test_bad_bounds_are_refused_by_name_and_value():
    for args, needle in (((0, 1, 2), "num_speculative_tokens must be >= 1, got 0"),
                         ((2, 0, 2), "prompt_lookup_min must be >= 1, got 0"),
                         ((2, 3, 2), r"prompt_lookup_max must be >= prompt_lookup_min "
                                     r"\(3\), got 2")):
        with pytest.raises(ValueError, match=needle):
            NgramProposer(*args)


def test_batch_form_equals_propose_one_and_the_reference_on_random_sequences():
    rng = np.random.default_rng(0)
    table = np.zeros((8, 48), dtype=np.int32)
    found = 0
    for _ in range(25):  # 25 batches of 8 rows: 200 cases
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        p = NgramProposer(k, lo, hi)
        lengths = rng.integers(0, 49, size=8)
        table[:] = rng.integers(0, 5, size=table.shape)  # junk past each row's length
        rows = [int(r) for r in rng.permutation(8)]
        caps = [int(c) for c in rng.integers(0, 7, size=8)]
        got = p.propose(table, lengths, rows, caps)
        one = [p.propose_one(table[r, :lengths[r]], c) for r, c in zip(rows, caps)]
        want = [reference(table[r, :lengths[r]].tolist(), min(k, c), lo, hi)
                for r, c in zip(rows, caps)]
        assert got == one == want
        assert all(len(d) <= c for d, c in zip(got, caps))
        found += sum(bool(d) for d in got)
    assert found > 50  # the vocabulary of 5 makes matches common
