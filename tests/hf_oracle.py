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


@dataclass
class ScoredTrace(GreedyTrace):
    """transformers' next-token distribution at each step of a given continuation."""

    logprobs: torch.Tensor  # [steps, vocab] log-probs of each step given the tokens before it


@torch.inference_mode()
def hf_scored(model, prompt_ids: list[int], continuation: list[int]) -> ScoredTrace:
    """transformers' forward over ``prompt_ids + continuation`` at once (teacher forcing):
    at each step of the continuation, transformers' argmax, its top-2 margin and its
    log-probs given the prompt and the continuation's earlier tokens.

    Given our greedy continuation, ``assert_greedy_match(ours, trace)`` checks what it
    checks against ``hf_greedy``: up to the first disagreement the two traces see the same
    prefix, so they hold the same tokens and margins; the cost is one forward, not one per
    token. ``assert_logprobs_match`` then compares the log-probs."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + continuation[:-1]], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1:]
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()  # [steps, vocab]
    top = torch.topk(logprobs, 2, dim=-1)
    return ScoredTrace(top.indices[:, 0].tolist(),
                       (top.values[:, 0] - top.values[:, 1]).tolist(), logprobs)


def assert_logprobs_match(ours: list[dict], ref: ScoredTrace, steps: int,
                          atol: float = 1e-3, label: str = "") -> int:
    """Over the first ``steps`` steps (the tokens ``assert_greedy_match`` compared), each
    top-k log-prob we returned ({token id: Logprob}) is transformers' log-prob of that token
    within ``atol``, and our k tokens are transformers' top k (a token ranked within ``atol``
    of the k-th counts as a tie). Returns the number of log-probs compared."""
    compared = 0
    for i in range(steps):
        k = len(ours[i])
        assert k > 0, f"{label}: no logprobs at step {i}"
        kth = float(torch.topk(ref.logprobs[i], k).values[-1])
        for token, lp in ours[i].items():
            expected = float(ref.logprobs[i, token])
            assert abs(lp.logprob - expected) <= atol, (
                f"{label}: step {i} token {token}: logprob {lp.logprob:.6f}, transformers "
                f"{expected:.6f}")
            assert expected >= kth - atol, (
                f"{label}: step {i} token {token} (transformers' logprob {expected:.6f}) is "
                f"not in transformers' top {k} (the {k}-th is {kth:.6f})")
            compared += 1
    return compared


def assert_outputs_match(outputs: list, hf_model, prompts: list[list[int]], min_tokens: int,
                         label: str = "") -> None:
    """Our greedy outputs for ``prompts`` (``RequestOutput``s sampled with ``logprobs``)
    against transformers on the same weights: the tokens (``assert_greedy_match``) and their
    top-k log-probs (``assert_logprobs_match``), over at least ``min_tokens`` tokens in all
    (a floor: near-ties everywhere would leave nothing compared)."""
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = out.outputs[0]
        ref = hf_scored(hf_model, prompt, list(ours.token_ids))
        where = f"{label} prompt {prompt[:4]}"
        steps = assert_greedy_match(list(ours.token_ids), ref, where)
        assert_logprobs_match(ours.logprobs, ref, steps, label=where)
        compared += steps
    assert compared >= min_tokens, (
        f"{label}: only {compared} tokens compared (floor {min_tokens}): near-ties everywhere?")
