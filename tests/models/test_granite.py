"""IBM Granite (embedding, residual and attention multipliers, logits scaling) against
transformers' GraniteForCausalLM on tiny random weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.models.granite import GraniteConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
# Granite-3's multipliers at this scale: none of them 1, none the Llama default
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
              attention_bias=True, mlp_bias=True, embedding_multiplier=6.0,
              residual_multiplier=0.4, attention_multiplier=0.1, logits_scaling=2.0,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _make(path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GraniteForCausalLM(tf.GraniteConfig(**CONFIG))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(20, 41, (n,), generator=g).tolist()
    return [torch.randint(0, CONFIG["vocab_size"], (k,), generator=g).tolist() for k in lens]


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=64)
    return LLM(str(path), **{**args, **kwargs})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("granite")
    return path, _make(path)


def test_greedy_and_logprobs_match_transformers(tiny):
    path, hf_model = tiny
    prompts = _prompts(4)
    outs = _llm(path).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=4 * 16, label="granite")


def test_batching_chunking_and_preemption_agree(tiny):
    """Together in small prefill chunks under preemption, and one at a time: the same
    greedy tokens, and every block is free afterwards."""
    path, _ = tiny
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=24, max_model_len=80,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert together == alone
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 24


def test_refusals_name_the_key():
    base = dict(CONFIG, architectures=["GraniteForCausalLM"])
    with pytest.raises(ConfigError, match="logits_scaling"):
        GraniteConfig.from_hf({**base, "logits_scaling": 0}, "GraniteForCausalLM")
    with pytest.raises(ConfigError, match="hidden_act"):
        GraniteConfig.from_hf({**base, "hidden_act": "relu"}, "GraniteForCausalLM")
    cfg = GraniteConfig.from_hf({k: v for k, v in base.items()
                                 if not k.endswith(("multiplier", "scaling"))},
                                "GraniteForCausalLM")
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier,
            cfg.logits_scaling) == (1.0, 1.0, 1.0, 1.0)  # transformers' defaults


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 4, "intermediate_size": 16}
    hf = tf.GraniteConfig(**minimal)
    ours = GraniteConfig.from_hf({"architectures": ["GraniteForCausalLM"], **minimal},
                                 "GraniteForCausalLM")
    assert (ours.max_position_embeddings, ours.num_key_value_heads, ours.tie_word_embeddings,
            ours.rms_norm_eps, ours.rope_theta, ours.attention_bias, ours.mlp_bias,
            ours.embedding_multiplier, ours.residual_multiplier, ours.attention_multiplier,
            ours.logits_scaling) == (
        hf.max_position_embeddings, hf.num_key_value_heads, hf.tie_word_embeddings,
        hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.attention_bias, hf.mlp_bias,
        hf.embedding_multiplier, hf.residual_multiplier, hf.attention_multiplier,
        hf.logits_scaling)
