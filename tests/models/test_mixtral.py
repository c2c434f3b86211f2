"""Mixtral (Mistral's attention, a softmax-routed MoE MLP in every layer) against
transformers' MixtralForCausalLM on tiny random weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.mixtral import MixtralConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            num_local_experts=6, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, sliding_window=10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(**BASE))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_greedy_and_logprobs_match_transformers(tiny):
    """Prompts of 20 to 40 tokens with 32 generated: well past the window of 10."""
    path, hf_model = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BASE["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(20, 41, (4,), generator=g)]
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=16, num_blocks=64)
    outs = llm.generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label="mixtral")


def test_config_reading_and_refusals():
    base = dict(BASE, architectures=["MixtralForCausalLM"])
    cfg = MixtralConfig.from_hf(base, "MixtralForCausalLM")
    assert cfg.layer_windows == (10, 10) and cfg.num_local_experts == 6
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        from vllmpy.models.mixtral import MixtralForCausalLM

        MixtralForCausalLM(MixtralConfig.from_hf({**base, "num_experts_per_tok": 7},
                                                 "MixtralForCausalLM"))
    with pytest.raises(ConfigError, match="hidden_act"):
        MixtralConfig.from_hf({**base, "hidden_act": "gelu"}, "MixtralForCausalLM")


def test_gguf_matches_transformers(tiny, tmp_path):
    """Mixtral as llama.cpp converts it: a ``llama`` GGUF with experts (q/k rows
    interleaved, the experts stacked per projection), loaded as Mixtral."""
    from models.moe_gguf import write_moe_gguf

    _, hf_model = tiny
    path = write_moe_gguf(tmp_path / "mixtral.gguf", hf_model, "llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, BASE["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(20, 41, (3,), generator=g)]
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
              num_blocks=64)
    assert type(llm.engine.engine_core.model_runner.model).__name__ == "MixtralForCausalLM"
    outs = llm.generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label="mixtral gguf")
