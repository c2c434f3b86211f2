"""Ungated experts (Nemotron-H's ReLU-squared MoE): the grouped path and the dense one a
CUDA graph captures against a token-by-token sum; both checkpoint spellings load."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllmpy.layers.moe import UngatedMoE, ungated_moe_dense, ungated_moe_reference


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 16, generator=g)
    w1, w2 = torch.randn(5, 12, 16, generator=g), torch.randn(5, 16, 12, generator=g)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g)
    return x, w1, w2, weights, ids


def test_grouped_and_dense_paths_match_the_sum_per_token():
    x, w1, w2, weights, ids = _case()
    expected = torch.stack([
        sum(weights[t, j] * (F.relu(x[t] @ w1[ids[t, j]].T) ** 2) @ w2[ids[t, j]].T
            for j in range(2)) for t in range(9)])
    torch.testing.assert_close(ungated_moe_reference(x, w1, w2, weights, ids), expected,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ungated_moe_dense(x, w1, w2, weights, ids), expected,
                               atol=1e-4, rtol=1e-4)


def test_loads_per_expert_and_stacked_tensors():
    x, w1, w2, weights, ids = _case(1)
    per_expert, stacked = UngatedMoE(5, 16, 12), UngatedMoE(5, 16, 12)
    for e in range(5):
        per_expert.load_expert_tensor(f"{e}.up_proj.weight", w1[e], f"experts.{e}.up")
        assert f"{e}.up_proj.weight" not in per_expert.missing()
    assert per_expert.missing() == [f"{e}.down_proj.weight" for e in range(5)]
    for e in range(5):
        per_expert.load_expert_tensor(f"{e}.down_proj.weight", w2[e], f"experts.{e}.down")
    stacked.load_expert_tensor("up_proj", w1, "experts.up_proj")
    stacked.load_expert_tensor("down_proj.weight", w2, "experts.down_proj.weight")
    assert per_expert.missing() == stacked.missing() == []
    assert torch.equal(per_expert(x, weights, ids), stacked(x, weights, ids))
    with pytest.raises(ValueError, match="names expert 5"):
        stacked.load_expert_tensor("5.up_proj.weight", w1[0], "experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="no matching model parameter"):
        stacked.load_expert_tensor("gate_proj", w1, "experts.gate_proj")
    with pytest.raises(ValueError, match="has shape"):
        stacked.load_expert_tensor("up_proj", w2, "experts.up_proj")
