"""fp8 KV pages on the GPU (the Triton kernels read them directly): greedy continuations
against bfloat16 pages, the model in bfloat16 both times, on random-weight models: the
tiny test models (decisive logits) and Qwen3-0.6B's real shapes with dummy weights."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from models.test_fp8_kv_cache_real import top_n_agreement
from models.test_tiny_models import COMMON, _make, _prompts

from vllmpy import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 32
TOP_N = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_N)
QWEN3_06B = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs",
                         "qwen3-0.6b")


def _continuations(path: str, kv: str, prompts, **kw):
    llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              kv_cache_dtype=kv, num_blocks=512, **kw)
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-0.6b-dummy"])
def test_fp8_pages_keep_the_greedy_continuations_of_bf16_pages_on_the_gpu(kind, tmp_path):
    """The rule of the CPU test on the real checkpoints (vLLM's check_logprobs_close): a
    continuation agrees when identical, or when at its first difference each run's token
    is among the other's top-5. At least 90% of 40 continuations agree."""
    if kind == "qwen3-0.6b-dummy":
        path, kw, vocab = QWEN3_06B, {"load_format": "dummy", "max_model_len": 1024}, 151936
    else:
        _make(kind, tmp_path)
        path, kw, vocab = str(tmp_path), {}, COMMON["vocab_size"]
    prompts = _prompts(40, vocab, seed=11)
    ref = _continuations(path, "bfloat16", prompts, **kw)
    fp8 = _continuations(path, "fp8", prompts, **kw)
    identical, agree, failures = top_n_agreement(ref, fp8)
    print(f"{kind} fp8 vs bf16 KV on cuda: {identical}/40 identical, {agree}/40 agree")
    assert agree >= 0.9 * len(prompts), (
        f"{kind}: {agree}/40 continuations agree ({identical} identical); "
        f"{failures}")
