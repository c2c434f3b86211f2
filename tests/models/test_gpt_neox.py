"""Tiny random-weight GPT-NeoX models against transformers on the same weights: attention
and MLP side by side (Pythia's form) with a quarter of each head rotating, and one after
the other without attention biases, half of each head rotating."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.models.gpt_neox import GPTNeoXConfig

VOCAB, POSITIONS = 384, 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
SHORT = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SEQUENTIAL = dict(use_parallel_residual=False, attention_bias=False, rotary_pct=0.5)


def _make(path, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=POSITIONS, rotary_pct=0.25,
                bos_token_id=0, eos_token_id=0) | overrides
    model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**args))
    with torch.no_grad():  # larger than default weights: decisive logits, long greedy runs
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lens]


def _llm(path, device: str = "cpu", **kwargs) -> LLM:
    args = dict(block_size=16, num_blocks=64) | kwargs
    return LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", **args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_neox")
    return path, _make(path)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_logprobs_match_transformers(tiny, device):
    path, hf_model = tiny
    prompts = _prompts(6)
    assert_outputs_match(_llm(path, device).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=6 * 16, label="gpt_neox")


def test_sequential_residual_matches_transformers(tmp_path):
    hf_model = _make(tmp_path, **SEQUENTIAL)
    prompts = _prompts(4, seed=3)
    assert_outputs_match(_llm(tmp_path).generate(prompts, GREEDY), hf_model, prompts,
                         min_tokens=4 * 16, label="gpt_neox sequential")


def test_legacy_rotary_keys():
    """Configs from before transformers 5 spell the rotary settings rotary_pct and
    rotary_emb_base."""
    cfg = GPTNeoXConfig.from_hf({"architectures": ["GPTNeoXForCausalLM"], "vocab_size": 8,
                                 "hidden_size": 64, "num_attention_heads": 4,
                                 "num_hidden_layers": 1, "intermediate_size": 16,
                                 "rotary_pct": 0.5, "rotary_emb_base": 5000},
                                "GPTNeoXForCausalLM")
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.head_dim) == (8, 5000.0, 16)


def test_batching_chunking_and_preemption_agree(tiny):
    """Together, one at a time, in prefill chunks of 7 tokens, and under preemption: the
    same greedy tokens, and every block is free afterwards."""
    path, _ = tiny
    prompts = _prompts(6, seed=2)
    base = _llm(path)
    together = [o.outputs[0].token_ids for o in base.generate(prompts, SHORT)]
    assert [base.generate([p], SHORT)[0].outputs[0].token_ids for p in prompts] == together
    chunked = _llm(path, max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, SHORT)] == together
    # 16 blocks of 4 tokens cannot hold 6 requests of up to 55 tokens: preemption is forced
    small = _llm(path, block_size=4, num_blocks=16, max_model_len=64)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, SHORT)] == together
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 16


def test_absent_keys_read_as_transformers_defaults():
    import transformers as tf

    minimal = {"vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 16}
    hf = tf.GPTNeoXConfig(**minimal)
    ours = GPTNeoXConfig.from_hf({"architectures": ["GPTNeoXForCausalLM"], **minimal},
                                 "GPTNeoXForCausalLM")
    head_dim = hf.hidden_size // hf.num_attention_heads
    assert (ours.max_position_embeddings, ours.tie_word_embeddings, ours.rope_theta,
            ours.rotary_dim, ours.use_parallel_residual, ours.attention_bias,
            ours.hidden_act, ours.layer_norm_eps) == (
        hf.max_position_embeddings, hf.tie_word_embeddings, hf.rope_parameters["rope_theta"],
        int(head_dim * hf.rope_parameters["partial_rotary_factor"]),
        hf.use_parallel_residual, hf.attention_bias, hf.hidden_act, hf.layer_norm_eps)
