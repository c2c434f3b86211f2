"""The MoE layer's checkpoint layouts, expert biases, GPT-OSS's clamped SwiGLU, the shared
expert and the expert-load counter, against transformers' own modules on random weights;
the grouped-GEMM kernels with biases and the clamped SwiGLU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import (
    ExpertLayout,
    FusedMoE,
    SparseMoeBlock,
    moe_reference,
    moe_stats_summary,
    select_experts,
)
from vllmpy.ops.fused_moe import fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, seed: int, scale: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_stacked_fused_and_per_expert_layouts_load_alike() -> None:
    e, h, i = 3, 8, 5
    gate, up, down = _randn(e, i, h, seed=1), _randn(e, i, h, seed=2), _randn(e, h, i, seed=3)
    per_expert = FusedMoE(e, h, i)
    for x in range(e):
        for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            per_expert.load_expert_tensor(f"{x}.{name}.weight", t[x], f"e.{x}.{name}.weight")
    stacked = FusedMoE(e, h, i)  # GGUF's ffn_*_exps
    for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        stacked.load_expert_tensor(f"{name}.weight", t, f"e.{name}.weight")
    fused = FusedMoE(e, h, i)  # transformers' in-memory experts
    fused.load_expert_tensor("gate_up_proj", torch.cat((gate, up), dim=1), "e.gate_up_proj")
    fused.load_expert_tensor("down_proj", down, "e.down_proj")
    for moe in (per_expert, stacked, fused):
        assert moe.missing() == []
        assert torch.equal(moe.w13.data, torch.cat((gate, up), dim=1))
        assert torch.equal(moe.w2.data, down)
    part = FusedMoE(e, h, i)
    part.load_expert_tensor("gate_proj.weight", gate, "e.gate_proj.weight")
    assert part.missing() == [f"{x}.{n}.weight" for x in range(e) for n in ("up_proj",
                                                                           "down_proj")]
    with pytest.raises(ValueError, match="shape"):
        part.load_expert_tensor("up_proj.weight", gate[:2], "e.up_proj.weight")
    with pytest.raises(ValueError, match="no matching"):
        part.load_expert_tensor("gate_up_proj_bias", gate[:, 0], "e.gate_up_proj_bias")
    with pytest.raises(ValueError, match="no matching"):
        part.load_expert_tensor("w9.weight", gate, "e.w9.weight")


def _gpt_oss_experts(e: int, h: int, i: int):
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = tf.GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                          swiglu_limit=1.5)
    experts = GptOssExperts(cfg).float().eval()
    with torch.no_grad():
        for n, p in experts.named_parameters():
            p.copy_(_randn(*p.shape, seed=len(n), scale=0.6))
    return experts, cfg


def test_gpt_oss_layout_biases_and_clamped_swiglu_match_transformers() -> None:
    """Transposed, interleaved gate/up with biases; a small limit so the clamps bite."""
    e, h, i, k = 4, 16, 12, 2
    experts, cfg = _gpt_oss_experts(e, h, i)
    moe = FusedMoE(e, h, i, layout=ExpertLayout(transposed=True, interleaved=True), bias=True,
                   activation="swigluoai", swiglu_alpha=cfg.swiglu_alpha,
                   swiglu_limit=cfg.swiglu_limit)
    for n, p in experts.named_parameters():
        moe.load_expert_tensor(n, p.detach(), f"mlp.experts.{n}")
    assert moe.missing() == []
    x = _randn(23, h, seed=9, scale=2.0)
    weights, ids = select_experts(_randn(23, e, seed=10, scale=2.0), k, True)
    with torch.no_grad():
        theirs = experts(x, ids, weights)
        ours = moe(x, weights, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    unbiased = FusedMoE(e, h, i, layout=moe.layout, bias=True)
    unbiased.load_expert_tensor("gate_up_proj", experts.gate_up_proj.detach(), "g")
    unbiased.load_expert_tensor("down_proj", experts.down_proj.detach(), "d")
    assert unbiased.missing() == ["gate_up_proj_bias", "down_proj_bias"]


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_kernels_with_biases_match_the_reference(activation: str) -> None:
    e, h, i, tokens, k = 5, 48, 40, 19, 2
    w13 = _randn(e, 2 * i, h, seed=1).to(DEVICE)
    w2 = _randn(e, h, i, seed=2).to(DEVICE)
    b13 = _randn(e, 2 * i, seed=3).to(DEVICE)
    b2 = _randn(e, h, seed=4).to(DEVICE)
    x = _randn(tokens, h, seed=5, scale=1.5).to(DEVICE)
    ids = torch.tensor([[0, 1]] + [[3, 0]] * (tokens - 1), device=DEVICE)  # 2 and 4 idle
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    args = dict(activation=activation, alpha=1.702, limit=0.8)
    ours = fused_moe(x, w13, w2, weights, ids, b13, b2, **args)
    ref = moe_reference(x, w13, w2, weights, ids, b13, b2, **args)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="both expert biases"):
        fused_moe(x, w13, w2, weights, ids, b13, None)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w13, w2, weights, ids, activation="gelu")


def test_shared_expert_with_sigmoid_gate_matches_qwen2_moe() -> None:
    import transformers as tf
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tf.Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6,
                            num_experts_per_tok=2, shared_expert_intermediate_size=12,
                            norm_topk_prob=False)
    theirs = Qwen2MoeSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            p.copy_(_randn(*p.shape, seed=len(n), scale=0.5))
    ours = SparseMoeBlock(16, 6, 8, 2, False, shared_intermediate_size=12, shared_gate=True)
    sd = theirs.state_dict()
    ours.gate.weight.data.copy_(sd["gate.weight"])
    ours.experts.load_expert_tensor("gate_up_proj", sd["experts.gate_up_proj"], "g")
    ours.experts.load_expert_tensor("down_proj", sd["experts.down_proj"], "d")
    ours.shared_expert.gate_up_proj.weight.data.copy_(  # type: ignore[union-attr]
        torch.cat((sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"])))
    ours.shared_expert.down_proj.weight.data.copy_(  # type: ignore[union-attr]
        sd["shared_expert.down_proj.weight"])
    ours.shared_expert_gate.weight.data.copy_(  # type: ignore[union-attr]
        sd["shared_expert_gate.weight"])
    x = _randn(13, 16, seed=7, scale=1.0)
    with torch.no_grad():
        out = theirs(x[None])
        expected = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)


def test_expert_load_is_counted_and_summarised(monkeypatch) -> None:
    monkeypatch.setenv("VT_MOE_STATS", "1")
    moe = FusedMoE(4, 8, 4)
    moe.w13.data.normal_()
    moe.w2.data.normal_()
    ids = torch.tensor([[0, 2], [0, 3], [0, 2]])
    moe(torch.randn(3, 8), torch.full((3, 2), 0.5), ids)
    moe(torch.randn(1, 8), torch.full((1, 2), 0.5), torch.tensor([[3, 0]]))
    assert moe.expert_tokens.tolist() == [4, 0, 2, 2]  # type: ignore[union-attr]
    lines = moe_stats_summary()
    assert any("8 routed over 4 experts, min 0 mean 2.0 max 4 (max/mean 2.00), 1 idle, "
               "busiest [0, 2, 3]" in line for line in lines)
    monkeypatch.setenv("VT_MOE_STATS", "0")
    assert FusedMoE(4, 8, 4).expert_tokens is None
