"""bf16 greedy agreement with transformers (bf16, same device) on tiny random models.

In bf16 a logit carries 8 significant bits, so two engines that round at different points
(fused kernels, packed GEMMs, attention accumulation) may order two near-tied tokens
differently; from there their continuations legitimately part. A continuation therefore
agrees when it is identical, or when at its first difference transformers' own top-2
margin is within a few bf16 units of its largest logit (the two tokens are tied at bf16
resolution). The share of identical continuations is reported too.
"""

from __future__ import annotations

import math

import pytest
import torch
from models.test_tiny_models import COMMON, _make, _prompts

from vllmpy import LLM, SamplingParams

TIE_ULPS = 4  # a margin within this many bf16 units of the largest logit is a tie
GOAL = 0.95


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@torch.inference_mode()
def hf_trace(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, per step, the top-2 margin in bf16 units of the largest logit."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens, margins = [], []
    for _ in range(steps):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1])
                       / bf16_ulp(float(logits.abs().max())))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                    past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_bf16_greedy_agrees_with_transformers(kind, device, tmp_path):
    n = 40 if device == "cuda" else 4  # the CPU run is a smoke check: bf16 is slow there
    hf = _make(kind, tmp_path).to(device=device, dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device=device, dtype="bfloat16",
              block_size=16, num_blocks=256)
    prompts = _prompts(n, COMMON["vocab_size"], seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                                ignore_eos=True), use_tqdm=False)
    identical = agree = 0
    disagreements = []
    for prompt, out in zip(prompts, outs):
        ours = list(out.outputs[0].token_ids)
        ref, margins = hf_trace(hf, prompt, 32)
        if ours == ref:
            identical += 1
            agree += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        if margins[i] <= TIE_ULPS:
            agree += 1
        else:
            disagreements.append((i, ours[i], ref[i], round(margins[i], 1)))
    print(f"{kind} {device} bf16: {identical}/{n} identical, {agree}/{n} agree")
    assert agree >= GOAL * n, (
        f"{kind} on {device}: {agree}/{n} continuations agree ({identical} identical); "
        f"disagreements (step, ours, transformers, margin in bf16 units): {disagreements}")
