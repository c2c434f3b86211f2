"""apply_grammar_bitmask against a plain Python reading of the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllmpy.structured_output.bitmask import (
    apply_grammar_bitmask,
    apply_step_grammar_bitmask,
)


def pack(allowed: list[set[int]], vocab_size: int) -> np.ndarray:
    """Rows of allowed token ids -> int32 words, bit j of word w = token 32 * w + j."""
    words = (vocab_size + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, ids in enumerate(allowed):
        for token in ids:
            out[row, token // 32] |= np.uint32(1) << np.uint32(token % 32)
    return out.view(np.int32)


@pytest.mark.parametrize("vocab_size", [32, 70, 1000])
def test_forbidden_tokens_become_minus_inf_and_others_are_kept(vocab_size):
    rng = np.random.default_rng(vocab_size)
    logits = torch.randn(4, vocab_size)
    original = logits.clone()
    # rows 3 and 1 are masked (in that order); rows 0 and 2 are left alone
    allowed = [set(rng.choice(vocab_size, size=5, replace=False).tolist()) | {vocab_size - 1},
               set(range(0, vocab_size, 2))]
    out = apply_grammar_bitmask(logits, pack(allowed, vocab_size), [3, 1])
    assert out is logits  # in place
    for logit_row, ids in ((3, allowed[0]), (1, allowed[1])):
        for token in range(vocab_size):
            if token in ids:
                assert logits[logit_row, token] == original[logit_row, token]
            else:
                assert logits[logit_row, token] == float("-inf")
    assert torch.equal(logits[[0, 2]], original[[0, 2]])


def test_all_bits_set_keeps_the_row_and_the_sign_bit_is_a_token():
    logits = torch.zeros(1, 64)
    apply_grammar_bitmask(logits, np.full((1, 2), -1, dtype=np.int32), [0])
    assert torch.isfinite(logits).all()
    only_31 = pack([{31, 63}], 64)
    assert only_31[0, 0] < 0  # bit 31 is the int32 sign bit
    apply_grammar_bitmask(logits, only_31, [0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31, 63]


def test_bad_shapes_are_refused():
    logits = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="covers 96 tokens, fewer than the 100"):
        apply_grammar_bitmask(logits, np.zeros((1, 3), dtype=np.int32), [0])
    with pytest.raises(ValueError, match="int32"):
        apply_grammar_bitmask(logits, np.zeros((1, 4), dtype=np.int64), [0])
    with pytest.raises(ValueError, match=r"\[2, words\]"):
        apply_grammar_bitmask(logits, np.zeros((1, 4), dtype=np.int32), [0, 1])


def test_step_mapping_follows_request_ids():
    vocab = 40
    logits = torch.zeros(3, vocab)
    # bitmask rows: "b" -> 0 allows {1}, "c" -> 1 allows {2}, "gone" -> 2 (not sampling)
    bitmask = pack([{1}, {2}, {3}], vocab)
    apply_step_grammar_bitmask(logits, bitmask, {"b": 0, "c": 1, "gone": 2}, ["c", "a", "b"])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [2]  # c
    assert torch.isfinite(logits[1]).all()  # a: no grammar
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [1]  # b
