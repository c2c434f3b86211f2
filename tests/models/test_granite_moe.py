"""Granite MoE (Granite's four multipliers around a top-k-then-softmax routed MoE MLP) and
GraniteMoeShared (a shared gated MLP beside the experts) against transformers'
GraniteMoeForCausalLM / GraniteMoeSharedForCausalLM on tiny random weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.granite_moe import GraniteMoeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# architecture -> (transformers classes, config); no multiplier is 1 in either
CONFIGS = {
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", dict(
        BASE, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=True,
        attention_bias=True, embedding_multiplier=6.0, residual_multiplier=0.4,
        attention_multiplier=0.1, logits_scaling=2.0)),
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedConfig", dict(
        BASE, num_local_experts=8, num_experts_per_tok=3, shared_intermediate_size=40,
        tie_word_embeddings=False, embedding_multiplier=4.0, residual_multiplier=0.6,
        attention_multiplier=0.15, logits_scaling=3.0)),
}
def _make(arch: str, path) -> torch.nn.Module:
    import transformers as tf

    config_cls, kwargs = CONFIGS[arch]
    torch.manual_seed(0)
    model = getattr(tf, arch)(getattr(tf, config_cls)(**kwargs))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
            else:
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _make(request.param, path)


def test_greedy_and_logprobs_match_transformers(tiny):
    arch, path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label=arch)


def test_checkpoint_names_are_the_original_ones(tiny):
    """transformers saves the original spelling, which the loader renames."""
    import json

    from safetensors import safe_open

    arch, path, _ = tiny
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in names
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in names
    shared = "model.layers.0.shared_mlp.input_linear.weight" in names
    assert shared == (arch == "GraniteMoeSharedForCausalLM")
    assert json.loads((path / "config.json").read_text())["architectures"] == [arch]


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens (a token's routing does not depend on its batch), and every block is
    free afterwards."""
    arch, path, _ = tiny
    if arch != "GraniteMoeSharedForCausalLM":
        pytest.skip("one config covers the schedule")
    prompts = _prompts(5, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=20, max_model_len=64,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 20


def _config(arch: str, **changes) -> GraniteMoeConfig:
    cfg = {**CONFIGS[arch][1], "architectures": [arch], **changes}
    return GraniteMoeConfig.from_hf(cfg, arch)


def test_refusals_name_the_key():
    moe = "GraniteMoeForCausalLM"
    with pytest.raises(ConfigError, match="hidden_act"):
        _config(moe, hidden_act="gelu")
    with pytest.raises(ConfigError, match="logits_scaling"):
        _config(moe, logits_scaling=0)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _config(moe, num_experts_per_tok=7)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _config(moe, num_experts_per_tok=0)
    with pytest.raises(ConfigError, match="shared_intermediate_size"):
        _config("GraniteMoeSharedForCausalLM", shared_intermediate_size=-1)
    # GraniteMoe has no shared MLP, whatever its config holds (as in transformers)
    assert _config(moe, shared_intermediate_size=32).shared_intermediate_size == 0
    assert _config("GraniteMoeSharedForCausalLM").shared_intermediate_size == 40


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_absent_keys_read_as_transformers_defaults(arch):
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 4, "intermediate_size": 16}
    hf = getattr(tf, CONFIGS[arch][0])(**minimal)
    ours = GraniteMoeConfig.from_hf({"architectures": [arch], **minimal}, arch)
    fields = ("max_position_embeddings", "num_key_value_heads", "tie_word_embeddings",
              "rms_norm_eps", "attention_bias", "embedding_multiplier",
              "residual_multiplier", "attention_multiplier", "logits_scaling",
              "num_local_experts", "num_experts_per_tok")
    assert [getattr(ours, f) for f in fields] == [getattr(hf, f) for f in fields]
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.shared_intermediate_size == getattr(hf, "shared_intermediate_size", 0)
