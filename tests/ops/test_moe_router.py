"""The one-launch softmax router against ``select_experts``'s PyTorch path (under Triton's
interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import select_experts
from vllmpy.ops.moe_router import MAX_EXPERTS, softmax_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (5, 60, 4), (3, 64, 6),
                                                  (2, 8, 2), (4, 256, 1), (1, 512, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_pytorch_routing(tokens, experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(tokens * 1000 + experts + top_k)
    logits = (torch.randn(tokens, experts, generator=g) * 3).to(DEVICE, dtype)
    weights, ids = softmax_topk(logits, top_k, renormalize)
    ref_w, ref_ids = select_experts(logits.cpu(), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), ref_ids)  # the same experts, largest first
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=1e-5, atol=1e-7)


def test_scale_and_ties():
    # equal logits: the lower expert ids first, as torch.topk gives them
    logits = torch.zeros(2, 16, device=DEVICE)
    logits[1, 7] = logits[1, 3] = 1.0
    weights, ids = softmax_topk(logits, 3, True, scale=2.5)
    assert ids.tolist() == [[0, 1, 2], [3, 7, 0]]
    torch.testing.assert_close(weights.sum(dim=1).cpu(), torch.full((2,), 2.5))


def test_refusals():
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(torch.zeros(1, 8), 9, True)
    with pytest.raises(ValueError, match=str(MAX_EXPERTS)):
        softmax_topk(torch.zeros(1, MAX_EXPERTS + 1), 2, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        softmax_topk(torch.zeros(8), 2, True)
    with pytest.raises(ValueError, match="dtype"):
        softmax_topk(torch.zeros(1, 8, dtype=torch.int32), 2, True)
