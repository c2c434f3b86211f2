"""The hybrid and latent-attention families in bf16 on a CUDA device (through the CUDA
graphs, recurrent layers included), against transformers in bf16 on the same device and the
same tiny random weights (the tiny models their CPU test files build). The agreement rule
is test_families_gpu's: identical continuations, or a first difference at a near-tie of
transformers' own logits. Where fewer than 90% agree (a tiny random model can be chaotic
in bf16), the engine's teacher-forced log-probs must be as close to transformers' float32
as transformers' own bf16 is, and 60% of the continuations agree, or 60% of as many as
transformers' own bf16 agrees on with its float32 where that is fewer. The Mamba2
families first check that the installed transformers normalizes their gated RMSNorm per
group (``assert_gated_norms_grouped``): against a release that does not, every comparison
here would measure the oracle."""

from __future__ import annotations

import copy

import pytest
import torch
from models.hybrid_harness import assert_gated_norms_grouped
from models.test_bf16_agreement import TIE_ULPS, bf16_ulp
from models.test_families_gpu import _errors_against_float32

from vllmpy import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _build(variant: str, path) -> tuple[torch.nn.Module, int]:
    if variant.startswith("deepseek-"):
        from models.test_deepseek import BASE, _make

        return _make(variant.removeprefix("deepseek-"), path), BASE["vocab_size"]
    if variant.startswith("qwen3"):
        from models.test_qwen3_next import VOCAB, _make
    else:
        from models.test_mamba2_families import VOCAB, _make
    return _make(variant, path), VOCAB


@torch.no_grad()
def hf_trace(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Transformers' greedy tokens, each step over the whole sequence (no cache: the
    families keep their recurrent states in different cache classes), and per step the
    top-2 margin in bf16 units of the largest logit."""
    device = next(model.parameters()).device
    tokens, margins = list(prompt), []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([tokens], device=device)).logits[0, -1].float()
        top = torch.topk(logits, 2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1])
                       / bf16_ulp(float(logits.abs().max())))
    return tokens[len(prompt):], margins


def agreement(continuations: list[list[int]], traces: list[tuple[list[int], list[float]]]
              ) -> tuple[int, int, list[tuple]]:
    """(identical, agree, disagreements) of greedy continuations against reference traces
    (``hf_trace``): agree when identical, or first different at a near-tie of the
    reference's logits; each disagreement as (step, token, reference token, margin)."""
    identical = agree = 0
    disagreements = []
    for ours, (ref, margins) in zip(continuations, traces, strict=True):
        if ours == ref:
            identical += 1
            agree += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
        if margins[i] <= TIE_ULPS:
            agree += 1
        else:
            disagreements.append((i, ours[i], ref[i], round(margins[i], 1)))
    return identical, agree, disagreements


VARIANTS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "mamba2", "nemotron_h",
            "granite_moe_hybrid", "falcon_h1", "deepseek-v2_lite", "deepseek-v3"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_agrees_with_transformers(variant, tmp_path):
    hf32, vocab = _build(variant, tmp_path)
    assert_gated_norms_grouped(hf32)
    hf32 = hf32.to(device="cuda")
    hf = copy.deepcopy(hf32).to(dtype=torch.bfloat16)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              block_size=16, num_blocks=256, max_num_seqs=32)
    g = torch.Generator().manual_seed(5)
    # lengths past one prefill chunk of the smallest tests, and a batch of 24 at once
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 80, (24,), generator=g)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                                ignore_eos=True), use_tqdm=False)
    hf_traces = [hf_trace(hf, prompt, 32) for prompt in prompts]
    identical, agree, disagreements = agreement(
        [list(out.outputs[0].token_ids) for out in outs], hf_traces)
    print(f"{variant} cuda bf16: {identical}/{len(prompts)} identical, "
          f"{agree}/{len(prompts)} agree")
    if agree >= 0.9 * len(prompts):
        return
    ours_err, hf_err = _errors_against_float32(llm, hf32, hf, prompts[:6])
    # transformers' own bf16 against its float32, by the same rule: the floor is 60% of
    # the prompts, or of those where fewer agree (a tiny model chaotic in bf16 parts from
    # its float32 as often in transformers' hands)
    _, hf_agree, _ = agreement([tokens for tokens, _ in hf_traces],
                               [hf_trace(hf32, prompt, 32) for prompt in prompts])
    print(f"{variant}: log-prob error against float32: ours {ours_err:.4f}, "
          f"transformers bf16 {hf_err:.4f}; transformers bf16 agrees with its float32 on "
          f"{hf_agree}/{len(prompts)}")
    assert agree >= 0.6 * min(len(prompts), hf_agree), (variant, identical, disagreements)
    assert ours_err <= 1.25 * hf_err, (variant, ours_err, hf_err, disagreements)
