"""The MoE block's routing and experts against transformers' own modules (Qwen3-MoE's
softmax router and experts, DeepSeek-V3's grouped sigmoid router) on random weights."""

from __future__ import annotations

import pytest
import torch

from vllmpy.layers.moe import FusedMoE, moe_reference, select_experts


def _qwen3_moe_block(num_experts: int, top_k: int, norm: bool):
    import transformers as tf
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = tf.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=num_experts,
                            num_experts_per_tok=top_k, norm_topk_prob=norm)
    torch.manual_seed(num_experts + top_k)
    block = Qwen3MoeSparseMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_routing_and_experts_match_transformers(norm: bool) -> None:
    block = _qwen3_moe_block(6, 2, norm)
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = select_experts(x @ block.gate.weight.T, 2, norm)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float())
        ours = moe_reference(x, block.experts.gate_up_proj, block.experts.down_proj,
                             weights, ids)
        torch.testing.assert_close(ours, block(x[None])[0], rtol=1e-5, atol=1e-5)


def test_experts_with_no_one_and_every_token() -> None:
    # expert 0 gets every token, expert 1 one token, expert 4 the other four, 2 and 3 none
    block = _qwen3_moe_block(5, 2, True)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1]] + [[4, 0]] * 4)
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = moe_reference(x, block.experts.gate_up_proj, block.experts.down_proj,
                             weights, ids)
        theirs = block.experts(x, ids, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_grouped_sigmoid_routing_matches_deepseek_v3() -> None:
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tf.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg).eval()
    torch.manual_seed(4)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(29, 16)
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 4, True, scoring="sigmoid",
                                      correction_bias=router.e_score_correction_bias,
                                      n_group=4, topk_group=2, routed_scaling_factor=2.5)
    # sorted=False leaves the order of the chosen experts unspecified: compare as sets
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # the groups bite: some token's best four experts by biased score are not all chosen
    choice = x @ router.weight.T
    plain = torch.topk(choice.sigmoid() + router.e_score_correction_bias, 4)[1].sort()[0]
    assert not torch.equal(plain, ids.sort()[0])


def test_routing_refusals() -> None:
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, 9, True)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits, 2, True, scoring="relu")
    with pytest.raises(ValueError, match="n_group"):
        select_experts(logits, 2, True, scoring="sigmoid", n_group=3, topk_group=1)


def test_expert_loading_and_refusals() -> None:
    moe = FusedMoE(2, 4, 3)
    gate = torch.randn(3, 4)
    moe.load_expert_tensor("1.gate_proj.weight", gate, "mlp.experts.1.gate_proj.weight")
    assert torch.equal(moe.w13.data[1, :3], gate)
    assert "0.gate_proj.weight" in moe.missing() and "1.gate_proj.weight" not in moe.missing()
    assert len(moe.missing()) == 5
    with pytest.raises(ValueError, match="names expert 2"):
        moe.load_expert_tensor("2.up_proj.weight", gate, "e.2.up_proj.weight")
    with pytest.raises(ValueError, match="shape"):
        moe.load_expert_tensor("0.down_proj.weight", gate, "e.0.down_proj.weight")
    with pytest.raises(ValueError, match="no matching"):
        moe.load_expert_tensor("0.w1.weight", gate, "e.0.w1.weight")
    with pytest.raises(ValueError, match="quantized MoE experts"):
        moe.load_expert_tensor("0.up_proj.qweight", gate.int(), "e.0.up_proj.qweight")
    with pytest.raises(ValueError, match="quantized MoE experts"):
        moe.load_expert_tensor("0.up_proj.weight", gate.to(torch.float8_e4m3fn),
                               "e.0.up_proj.weight")


def test_the_block_marks_its_router_and_float_experts_take_dense_weights() -> None:
    from vllmpy.layers.moe import SparseMoeBlock
    from vllmpy.layers.quantization.base import is_router

    block = SparseMoeBlock(4, 2, 3, 1, True, shared_intermediate_size=5)
    assert is_router(block.gate) and not is_router(block.shared_expert.down_proj)
    w13, w2 = torch.randn(2, 6, 4), torch.randn(2, 4, 3)
    block.experts.load_dense(w13, w2)
    assert block.experts.missing() == [] and block.experts.describe_experts() is None
    assert torch.equal(block.experts.w13.data, w13) and torch.equal(block.experts.w2.data, w2)
