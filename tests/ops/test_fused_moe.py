"""The grouped-GEMM MoE kernels against the layer's PyTorch reference (under Triton's
interpreter on the CPU), on random routings with experts that get no token, one token,
and every token."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import moe_reference, select_experts
from vllmpy.ops.fused_moe import BLOCK_M, align_by_expert, fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(DEVICE, dtype)
    return w13, w2


def test_align_pads_each_expert_run() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [2, 0]], device=DEVICE)
    sorted_pairs, block_expert = align_by_expert(ids, 5)
    pairs = sorted_pairs.tolist()
    experts = block_expert.tolist()
    seen = {}
    for b, e in enumerate(experts):
        block = pairs[b * BLOCK_M:(b + 1) * BLOCK_M]
        real = [p for p in block if p < 6]
        if e == 5:
            assert not real
            continue
        seen.setdefault(e, []).extend(real)
        assert all(ids.reshape(-1)[p].item() == e for p in real)
    assert seen == {0: [1, 5], 2: [0, 2, 4], 3: [3]}  # expert 1 and 4 get no block


@pytest.mark.parametrize("pairs,experts", [(1, 4), (6, 5), (64, 128), (64, 3)])
def test_one_program_alignment_equals_the_sort(pairs: int, experts: int) -> None:
    g = torch.Generator().manual_seed(pairs + experts)
    ids = torch.randint(0, experts, (pairs, 1), generator=g).to(DEVICE)
    kernel = align_by_expert(ids, experts, one_program=True)
    sort = align_by_expert(ids, experts, one_program=False)
    assert torch.equal(kernel[0], sort[0]) and torch.equal(kernel[1], sort[1])


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 4), (7, 2, 8), (40, 3, 6)])
def test_matches_reference_on_random_routings(tokens: int, top_k: int, experts: int) -> None:
    h, i = 48, 40  # neither a multiple of the 64-wide tiles
    w13, w2 = _weights(experts, h, i, torch.float32, tokens)
    g = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    logits = torch.randn(tokens, experts, generator=g).to(DEVICE)
    weights, ids = select_experts(logits, top_k, True)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_no_one_and_every_token() -> None:
    w13, w2 = _weights(5, 32, 16, torch.float32, 9)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    ids = torch.tensor([[0, 1]] + [[4, 0]] * 19, device=DEVICE)  # 0 all, 1 one, 2 and 3 none
    weights = torch.rand(20, 2, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, moe_reference(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16() -> None:
    w13, w2 = _weights(4, 64, 32, torch.bfloat16, 12)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(13)).to(DEVICE,
                                                                          torch.bfloat16)
    weights, ids = select_experts(torch.randn(9, 4, generator=torch.Generator().manual_seed(
        14)).to(DEVICE), 2, False)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    ref = moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2.0**-6 * scale)


def test_refusals() -> None:
    w13, w2 = _weights(2, 8, 4, torch.float32, 1)
    x = torch.randn(3, 8, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(3, 1, device=DEVICE)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, weights, ids)
