"""The split argmax against torch.argmax (under the Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from vllmpy.ops.argmax import CHUNK, argmax_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(dtype: torch.dtype, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, vocab, generator=g)
    x[1, CHUNK + 5] = x[1, 2 * CHUNK + 1] = 40.0  # a tie across chunks: the first wins
    x[1, 3] = 39.0
    x[2, 2 * CHUNK + 9] = float("nan")  # NaN is larger than any number
    x[2, 4] = float("inf")
    x[3] = float("-inf")  # every logit masked: position 0
    x[4] = -1.0
    x[4, CHUNK + 1] = -0.0  # -0.0 and +0.0 tie: the first wins
    x[4, CHUNK + 2] = 0.0
    x[5, vocab - 1] = 50.0  # in the last, partial chunk
    x[6, :] = -3.0
    x[6, 0] = -2.5
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_argmax(dtype: torch.dtype) -> None:
    logits = _logits(dtype, 2 * CHUNK + 100)
    want = torch.argmax(logits.float(), dim=-1)
    assert want[1] == CHUNK + 5 and want[2] == 2 * CHUNK + 9 and want[3] == 0
    torch.testing.assert_close(argmax_rows(logits), want, rtol=0, atol=0)
    out = torch.full((7,), -1, dtype=torch.int64, device=DEVICE)
    assert argmax_rows(logits, out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_rows_with_a_stride_and_one_chunk() -> None:
    base = _logits(torch.float32, 2 * CHUNK + 100)
    view = base[::2, :300]  # a row stride past the width, a single partial chunk
    torch.testing.assert_close(argmax_rows(view), torch.argmax(view, dim=-1), rtol=0, atol=0)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        argmax_rows(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="out must be"):
        argmax_rows(torch.zeros(2, 4, device=DEVICE), out=torch.zeros(3, dtype=torch.int64))
    assert argmax_rows(torch.zeros(0, 4, device=DEVICE)).shape == (0,)
