"""Hugging Face transformers as the independent oracle for greedy tokens.

``hf_greedy`` runs transformers' own forward step by step (no sampling code involved)
and records, for every step, the margin between the top two log-probabilities, so a
comparison can tell a real disagreement from a near-tie that float noise may flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3


@dataclass
class GreedyTrace:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 log-prob at each step


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> GreedyTrace:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_new_tokens):
        logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        top = torch.topk(logprobs, 2)
        tok = int(top.indices[0])
        tokens.append(tok)
        margins.append(float(top.values[0] - top.values[1]))
        out = model(input_ids=torch.tensor([[tok]], device=device), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
    return GreedyTrace(tokens, margins)


def assert_greedy_match(ours: list[int], ref: GreedyTrace, label: str = "") -> int:
    """Token for token, except after a step where transformers' own top-2 margin is below
    NEAR_TIE (from there the two may legitimately diverge). Returns the tokens compared."""
    assert len(ours) == len(ref.tokens), (
        f"{label}: got {len(ours)} tokens, transformers {len(ref.tokens)}")
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            assert ref.margins[i] < NEAR_TIE, (
                f"{label}: token {i} differs (ours {a}, transformers {b}) where transformers' "
                f"top-2 margin is {ref.margins[i]:.2e} >= {NEAR_TIE}; ours={ours} "
                f"ref={ref.tokens}")
            return i
        if ref.margins[i] < NEAR_TIE:
            return i + 1
    return len(ours)
