"""PhiMoE (LayerNorms with biases, attention and head biases, LongRoPE with its own
mscales, sparsemixer top-2 routing) against transformers' PhimoeForCausalLM on tiny random
weights, and the sparsemixer alone against transformers' router function."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.phimoe import PhimoeConfig, PhimoeForCausalLM, sparsemixer_top2

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
            num_local_experts=6, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
PAIRS = 8  # rotating pairs per head (head_dim 16)

# Phi-3.5-MoE's shape (every bias on, a window shorter than the requests, training-only
# input jitter that inference ignores) and a LongRoPE one with distinct mscales, a tied
# head and a wide sparsemixer gap, so that the second expert's weight often falls below 1
CONFIGS = {
    "biases_window": dict(attention_bias=True, lm_head_bias=True, sliding_window=10,
                          input_jitter_noise=0.01, router_jitter_noise=0.01),
    "longrope_tied": dict(
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.2 * i for i in range(PAIRS)],
                         "long_factor": [3.0 + 0.5 * i for i in range(PAIRS)],
                         "short_mscale": 1.2, "long_mscale": 1.4,
                         "original_max_position_embeddings": 128},
        tie_word_embeddings=True, router_jitter_noise=0.2),
}


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.PhimoeForCausalLM(tf.PhimoeConfig(**BASE, **CONFIGS[kind]))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.15)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"phimoe-{request.param}")
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    """Prompts of 20 to 40 tokens with 32 generated: past the window of 10 and short of
    original_max_position_embeddings (128), where transformers rotates with short_factor
    and short_mscale."""
    kind, path, hf_model = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BASE["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(20, 41, (4,), generator=g)]
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=16, num_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=f"phimoe {kind}")


def _router_logits() -> torch.Tensor:
    """Random rows, and rows built on the mask's edges: exact ties, gaps just inside and
    just outside 2 * eps of the best (relative), negative and zero maxima."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(256, 8, generator=g) * 2,
            torch.randn(64, 8, generator=g) * 0.01]  # everything close together
    edge = torch.randn(64, 8, generator=g)
    best = edge.max(dim=-1, keepdim=True).values.abs() + 0.5
    edge[:, 0:1] = best
    for j, gap in enumerate((0.0, 0.0199, 0.0201, 0.019, 0.021, 0.2), start=1):
        edge[:, j:j + 1] = best * (1 - gap)  # a gap of 2 * 0.01 is the edge at eps 0.01
    rows.append(edge)
    rows.append(-edge.abs())  # every logit negative
    rows.append(torch.tensor([[0.0] * 8, [0.0, 0.0, -1.0, -1e-3, 0, 0, 0, 5.0],
                              [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                              [3.0, 3.0, 2.96, 2.94, -3.0, 0.0, 3.0, 1.0]]))
    return torch.cat(rows)


@pytest.mark.parametrize("eps", [0.01, 0.0, 0.2])
def test_sparsemixer_matches_transformers_router(eps):
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    logits = _router_logits()
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    for case in (logits, logits[:, perm]):  # the edge experts at other positions too
        weights, ids = sparsemixer_top2(case, eps)
        ref_weights, ref_ids = sparsemixer(case, jitter_eps=eps, training=False)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
    # bf16 logits are routed in fp32, as transformers routes them once upcast
    half = logits.bfloat16()
    weights, ids = sparsemixer_top2(half, eps)
    ref_weights, ref_ids = sparsemixer(half.float(), jitter_eps=eps, training=False)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_transformers5_names_load_the_same(tiny):
    """transformers 5's in-memory names (``mlp.router``, fused ``mlp.experts.gate_up_proj``
    / ``down_proj``) fill the model exactly as the checkpoint's per-expert tensors do."""
    kind, path, hf_model = tiny
    import json

    from safetensors.torch import load_file

    cfg = PhimoeConfig.from_hf(json.loads((path / "config.json").read_text()),
                               "PhimoeForCausalLM")
    from_checkpoint, from_v5 = PhimoeForCausalLM(cfg), PhimoeForCausalLM(cfg)
    from_checkpoint.load_weights(load_file(str(path / "model.safetensors")).items())
    from_v5.load_weights(hf_model.state_dict().items())
    ours, theirs = from_checkpoint.state_dict(), from_v5.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_config_reading_and_refusals():
    base = dict(BASE, architectures=["PhimoeForCausalLM"], sliding_window=10,
                attention_bias=True, lm_head_bias=True)
    cfg = PhimoeConfig.from_hf(base, "PhimoeForCausalLM")
    assert cfg.layer_windows == (10, 10) and cfg.router_jitter_noise == 0.01
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None  # PhimoeConfig's defaults
    longrope = dict(CONFIGS["longrope_tied"]["rope_parameters"])
    top_level = PhimoeConfig.from_hf({**base, "rope_parameters": longrope,
                                      "original_max_position_embeddings": 64},
                                     "PhimoeForCausalLM")
    assert top_level.rope_scaling["original_max_position_embeddings"] == 64
    refused = {
        "num_experts_per_tok": {"num_experts_per_tok": 4},
        "hidden_act": {"hidden_act": "gelu"},
        "num_local_experts": {"num_local_experts": 1},
        "router_jitter_noise": {"router_jitter_noise": -0.1},
        "lm_head_bias": {"tie_word_embeddings": True},
        "partial_rotary_factor": {"partial_rotary_factor": 0.5},
        "rope type 'yarn'": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0,
                                                 "original_max_position_embeddings": 64}},
        "short_mscale": {"rope_parameters": {k: v for k, v in longrope.items()
                                             if k != "short_mscale"}},
    }
    for field, change in refused.items():
        with pytest.raises(ConfigError, match=field):
            PhimoeConfig.from_hf({**base, **change}, "PhimoeForCausalLM")
