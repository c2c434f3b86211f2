"""logprobs and prompt_logprobs: the library against transformers on the same GGUF file, and
the server's JSON (completions, echo, chat, streaming, refusals) over a real socket."""

from __future__ import annotations

import math
import os

import httpx
import pytest
import torch

from vllmpy import LLM, SamplingParams
from vllmpy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllmpy.entrypoints.openai.serving_common import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from vllmpy.outputs import Logprob

TOL = 1e-3  # logprobs against transformers' fp32 log-softmax
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when "
               "Johannes Gutenberg combined movable metal type with an oil-based ink and")


# ---- request mapping and JSON shapes (no model) -------------------------------------------


def test_request_fields_map_to_sampling_params():
    def completion(**body):
        return CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params()

    def chat(**body):
        return ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], **body}).to_sampling_params()

    assert (completion(logprobs=3).logprobs, completion(logprobs=3).prompt_logprobs) == (3, None)
    echo = completion(logprobs=2, echo=True)
    assert (echo.logprobs, echo.prompt_logprobs) == (2, 2)  # echo scores the prompt too
    assert completion(logprobs=2, echo=True, prompt_logprobs=-1).prompt_logprobs == -1
    assert completion(echo=True).prompt_logprobs is None
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).logprobs is None
    assert chat(prompt_logprobs=-1).prompt_logprobs == -1


def test_openai_shapes_follow_vllm():
    steps: list[dict[int, Logprob] | None] = [
        None,
        {7: Logprob(-1.25, 3, " b"), 4: Logprob(-0.5, 1, " a"), 9: Logprob(-1.0, 2, " c")},
        {4: Logprob(float("-inf"), 40, " a"), 1: Logprob(-0.1, 1, "x")},
    ]
    comp = completion_logprobs([3, 7, 4], steps, tokenizer=None, initial_text_offset=10)
    assert comp.tokens == ["", " b", " a"]  # no logprobs and no tokenizer: no text
    assert comp.token_logprobs == [None, -1.25, -9999.0]
    assert comp.text_offset == [10, 10, 12]
    assert comp.top_logprobs == [None, {" b": -1.25, " a": -0.5, " c": -1.0},
                                 {" a": -9999.0, "x": -0.1}]
    chat = chat_logprobs([7, 4], [steps[1], steps[2]], tokenizer=None, top_logprobs=2)
    assert chat.content is not None and chat.refusal is None
    first = chat.content[0]
    assert (first.token, first.logprob, first.bytes) == (" b", -1.25, list(b" b"))
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [(" a", -0.5), (" c", -1.0)]
    everything = chat_logprobs([7], [steps[1]], None, -1).content
    assert everything is not None
    assert [t.token for t in everything[0].top_logprobs] == [" a", " c", " b"]
    assert prompt_logprobs_json(steps[:2]) == [None, {
        "7": {"logprob": -1.25, "rank": 3, "decoded_token": " b"},
        "4": {"logprob": -0.5, "rank": 1, "decoded_token": " a"},
        "9": {"logprob": -1.0, "rank": 2, "decoded_token": " c"}}]


# ---- the library against transformers -----------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(smollm_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(smollm_path):
    # A small step budget splits the long prompt into several prefill chunks.
    return LLM(smollm_path, device="cpu", dtype="float32", num_blocks=64, max_model_len=512,
               max_num_batched_tokens=8, max_logprobs=-1)


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits; row p scores the token at p + 1."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def assert_rank(row: torch.Tensor, lp: Logprob) -> None:
    """The rank agrees with a full sort of transformers' row, up to values within TOL."""
    assert lp.rank is not None
    lowest = int((row > lp.logprob + TOL).sum()) + 1
    highest = int((row > lp.logprob - TOL).sum()) + 1
    assert lowest <= lp.rank <= highest, (lp, lowest, highest)


def assert_position(ref: torch.Tensor, step: dict[int, Logprob], token: int, k: int) -> None:
    """One position: the scored token first, then its top k, all matching ``ref``."""
    assert next(iter(step)) == token
    assert len(step) in (k, k + 1)
    kth = float(ref.topk(k).values[-1]) if k else math.inf
    for token_id, lp in step.items():
        assert abs(lp.logprob - float(ref[token_id])) < TOL, (token_id, lp, float(ref[token_id]))
        assert_rank(ref, lp)
        if token_id != token:
            assert float(ref[token_id]) > kth - TOL  # one of the k most likely


@pytest.mark.slow
def test_prompt_and_sample_logprobs_match_transformers(llm, hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=4, prompt_logprobs=3,
                            ignore_eos=True)
    for out in llm.generate(["The capital of France is", LONG_PROMPT], params, use_tqdm=False):
        prompt, c = out.prompt_token_ids, out.outputs[0]
        ref = hf_logits(hf_model, prompt + c.token_ids).log_softmax(dim=-1)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            step = out.prompt_logprobs[p]
            assert step is not None, f"prompt position {p} was not scored"
            assert_position(ref[p - 1], step, prompt[p], 3)
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 5
        for j, token in enumerate(c.token_ids):
            assert_position(ref[len(prompt) + j - 1], c.logprobs[j], token, 4)
        assert c.cumulative_logprob == pytest.approx(
            sum(c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)), abs=1e-6)
    assert len(llm.tokenizer.encode(LONG_PROMPT)) > 2 * 8  # three chunks at least


@pytest.mark.slow
def test_whole_vocabulary_ranks_agree_with_a_full_sort(llm):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1, prompt_logprobs=-1)
    out = llm.generate("Water boils at", params, use_tqdm=False)[0]
    vocab = llm.config.model.text_config.vocab_size
    steps = [s for s in out.prompt_logprobs[1:]] + out.outputs[0].logprobs
    scored = out.prompt_token_ids[1:] + out.outputs[0].token_ids
    for step, token in zip(steps, scored):
        assert step is not None and len(step) == vocab
        ordered = sorted((lp.logprob for lp in step.values()), reverse=True)
        for token_id in (token, *list(step)[1:40]):
            lp = step[token_id]
            assert lp.rank == ordered.index(lp.logprob) + 1
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1  # greedy


@pytest.mark.slow
def test_logprobs_modes_against_transformers(llm, hf_model):
    prompt = "Once upon a time"
    temperature, top_k = 0.8, 5

    def run(mode: str):
        params = SamplingParams(temperature=temperature, top_k=top_k, seed=11, max_tokens=3,
                                logprobs=top_k, logprobs_mode=mode, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0]

    outs = {m: run(m) for m in ("raw_logprobs", "raw_logits", "processed_logprobs",
                                "processed_logits")}
    tokens = outs["raw_logprobs"].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == tokens for o in outs.values())  # same seed, same draw
    ids = outs["raw_logprobs"].prompt_token_ids
    logits = hf_logits(hf_model, ids + tokens)[len(ids) - 1:]
    kth = logits.topk(top_k, dim=-1).values[:, -1:]
    processed = torch.where(logits >= kth, logits / temperature, float("-inf"))
    refs = {"raw_logprobs": logits.log_softmax(-1), "raw_logits": logits,
            "processed_logprobs": processed.log_softmax(-1), "processed_logits": processed}
    for mode, out in outs.items():
        c = out.outputs[0]
        assert c.cumulative_logprob == pytest.approx(
            sum(step[t].logprob for step, t in zip(c.logprobs, tokens)), abs=1e-5)
        for j, token in enumerate(tokens):
            step = c.logprobs[j]
            assert next(iter(step)) == token and len(step) == top_k  # the draw is in the top-k
            for token_id, lp in step.items():
                assert abs(lp.logprob - float(refs[mode][j, token_id])) < TOL, (mode, j, lp)
                assert_rank(refs[mode][j], lp)


@pytest.mark.slow
def test_listed_token_ids_replace_the_top(llm, hf_model):
    tok = llm.tokenizer
    listed = [tok.encode(w, add_special_tokens=False)[0] for w in (" Paris", " London", " the")]
    params = SamplingParams(temperature=0.0, max_tokens=2, logprob_token_ids=listed)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    c = out.outputs[0]
    ref = hf_logits(hf_model, out.prompt_token_ids + c.token_ids).log_softmax(-1)
    for j, token in enumerate(c.token_ids):
        step = c.logprobs[j]
        assert list(step)[0] == token and set(step) == {token, *listed}
        row = ref[len(out.prompt_token_ids) + j - 1]
        assert step[token].rank == 1  # greedy: first over the whole vocabulary
        for token_id, lp in step.items():
            assert abs(lp.logprob - float(row[token_id])) < TOL
            assert_rank(row, lp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("x", SamplingParams(logprob_token_ids=[10**7]), use_tqdm=False)


# ---- the server ----------------------------------------------------------------------------


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=300)


CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.mark.slow
@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": "abc"}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": -4}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 2, "stream": True},
     "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": -9}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": "x"}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -3},
     "top_logprobs"),
])
def test_logprobs_refusals_over_http(server, route, body, param):
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400
    assert param in err["message"]


@pytest.mark.slow
def test_echo_on_token_ids_scores_every_prompt_token(server, llm, hf_model):
    """What lm-eval's loglikelihood sends: token ids, echo, logprobs=1, max_tokens=1."""
    ids = llm.tokenizer.encode("Paris is the capital and largest city of France.")
    r = post(server, "completions", {"prompt": ids, "echo": True, "logprobs": 1,
                                     "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]
    n = len(ids) + 1  # every prompt token, then the generated one
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == n
    assert len(lps["top_logprobs"]) == len(lps["text_offset"]) == n
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    generated = llm.generate(ids, SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)[0].outputs[0].token_ids
    ref = hf_logits(hf_model, ids + generated).log_softmax(-1)
    for p in range(1, n):
        token = (ids + generated)[p]
        assert abs(lps["token_logprobs"][p] - float(ref[p - 1, token])) < TOL
        top = lps["top_logprobs"][p]
        assert 1 <= len(top) <= 2 and lps["tokens"][p] in top
        assert abs(max(top.values()) - float(ref[p - 1].max())) < TOL
    # greedy: the generated token is the most likely one
    assert lps["token_logprobs"][-1] == max(lps["top_logprobs"][-1].values())
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None
    assert list(prompt_lps[1])[0] == str(ids[1])
    assert set(prompt_lps[1][str(ids[1])]) == {"logprob", "rank", "decoded_token"}


@pytest.mark.slow
def test_completion_logprobs_stream_per_delta(server):
    c = server.client()
    body = dict(model=None, prompt="The three primary colors are", max_tokens=8,
                temperature=0, logprobs=3)
    full = c.completions.create(**body)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == full.usage.completion_tokens == 8
    assert "".join(lp.tokens) == full.choices[0].text
    assert all(len(top) in (3, 4) and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset[0] == 0
    assert getattr(full.choices[0], "prompt_logprobs", None) is None  # not asked for
    chunks = [ch for ch in c.completions.create(**body, stream=True) if ch.choices]
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(
        lp.token_logprobs, abs=1e-4)
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


@pytest.mark.slow
def test_chat_logprobs_and_prompt_logprobs(server):
    c = server.client()
    full = c.chat.completions.create(model=None, messages=CHAT, max_tokens=6, temperature=0,
                                     logprobs=True, top_logprobs=3,
                                     extra_body={"prompt_logprobs": 2})
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0]
        assert entry.bytes == list(entry.token.encode("utf-8"))
    prompt_lps = full.model_dump()["prompt_logprobs"]
    assert len(prompt_lps) == full.usage.prompt_tokens and prompt_lps[0] is None
    assert all(1 <= len(step) <= 3 for step in prompt_lps[1:])
    bare = c.chat.completions.create(model=None, messages=CHAT, max_tokens=6, temperature=0,
                                     logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    assert [e.token for e in bare.choices[0].logprobs.content] == [e.token for e in content]
    assert "prompt_logprobs" not in bare.model_dump()
    stream = c.chat.completions.create(model=None, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)


@pytest.mark.slow
def test_chat_whole_vocabulary_top_logprobs(server, llm):
    r = post(server, "chat/completions", {"messages": CHAT, "max_tokens": 1, "temperature": 0,
                                          "logprobs": True, "top_logprobs": -1})
    assert r.status_code == 200, r.text
    entry = r.json()["choices"][0]["logprobs"]["content"][0]
    assert len(entry["top_logprobs"]) == llm.config.model.text_config.vocab_size
    assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the top one
    values = [t["logprob"] for t in entry["top_logprobs"]]
    assert values == sorted(values, reverse=True)


@pytest.mark.slow
def test_prompt_logprobs_survive_a_prefix_cache_hit(llm):
    prompt = LONG_PROMPT + " " + LONG_PROMPT  # more than one full KV block
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert all(step is not None for step in first.prompt_logprobs[1:])
    assert second.prompt_logprobs == first.prompt_logprobs
