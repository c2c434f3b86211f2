"""Tiny random-weight Llama, Qwen2 and Qwen3 against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_greedy_match, hf_greedy

from vllmpy import LLM, SamplingParams

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        cfg = tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)
        model = tf.Qwen3ForCausalLM(cfg)
    # Larger-than-default weights make the logits decisive, so greedy paths are long.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def _prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _make(request.param, path)
    return request.param, path, model


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def test_greedy_matches_transformers(tiny, device):
    kind, path, hf_model = tiny
    llm = LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", block_size=16, num_blocks=64)
    prompts = _prompts(8, COMMON["vocab_size"])
    outs = llm.generate(prompts, GREEDY)
    compared = 0
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        ref = hf_greedy(hf_model, prompt, 32)
        compared += assert_greedy_match(out.outputs[0].token_ids, ref, f"{kind} {prompt[:4]}")
    assert compared >= 8 * 16, f"too few tokens compared ({compared}): near-ties everywhere?"


def test_batching_chunking_and_preemption_agree(tiny, device):
    """Together, one at a time, in small prefill chunks, and under preemption: the same
    greedy tokens, and every block is free afterwards."""
    kind, path, _ = tiny
    prompts = _prompts(16, COMMON["vocab_size"], seed=2)
    base = LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", block_size=16, num_blocks=128)
    together = [o.outputs[0].token_ids for o in base.generate(prompts, GREEDY)]
    alone = [base.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert together == alone

    chunked = LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", block_size=16, num_blocks=128,
                  max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY)] == together

    # 12 blocks of 4 tokens cannot hold 16 requests of up to 71 tokens: preemption is forced
    small = LLM(str(path), skip_tokenizer_init=True, device=device, dtype="float32", block_size=4, num_blocks=20,
                max_model_len=80)
    outs = small.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == together
    core = small.engine.engine_core
    assert core.scheduler.num_preemptions_total > 0
    assert core.kv_cache_manager.num_free_blocks == 20
