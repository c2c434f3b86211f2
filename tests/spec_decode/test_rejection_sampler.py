"""The rejection sampler against first principles: greedy verification is exact, and the
tokens a step emits are distributed as the target's own, position by position (chi-square
over a small vocabulary, many trials), whatever the drafts and their proposal."""

from __future__ import annotations

import pytest
import torch

from vllmpy.sample.metadata import SamplingMetadata
from vllmpy.sampling_params import SamplingParams
from vllmpy.spec_decode.rejection_sampler import rejection_sample

VOCAB = 5


def metadata(params: list[SamplingParams], generators=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[0]] * n, [[]] * n,
                                  generators or [None] * n, [set()] * n, VOCAB,
                                  torch.device("cpu"))


def test_greedy_accepts_the_argmax_prefix_then_emits_the_target_token():
    # Two requests: 3 drafts (the first two right, the third wrong), then 2 drafts (both
    # right: the bonus row's argmax follows).
    argmax = [1, 3, 0, 4, 2, 2, 1]
    logits = torch.full((7, VOCAB), -1.0)
    logits[torch.arange(7), torch.tensor(argmax)] = 3.0
    drafts = torch.tensor([1, 3, 2, 2, 2])
    out = rejection_sample(logits, metadata([SamplingParams(temperature=0)] * 7), [3, 2],
                           drafts)
    assert out.num_emitted.tolist() == [3, 3]
    assert out.token_ids.tolist() == [[1, 3, 0, -1], [2, 2, 1, -1]]


def test_no_drafts_is_one_ordinary_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0]])
    out = rejection_sample(logits, metadata([SamplingParams(temperature=0)]), [0],
                           torch.zeros(0, dtype=torch.int64))
    assert out.token_ids.tolist() == [[1]] and out.num_emitted.tolist() == [1]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="logits rows"):
        rejection_sample(torch.zeros(3, VOCAB), metadata([SamplingParams()] * 3), [1],
                         torch.zeros(1, dtype=torch.int64))


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` under ``probs`` (Pearson, df = categories - 1)."""
    n = counts.sum()
    expected = probs * n
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat.double() / 2))


@pytest.mark.parametrize("proposal", ["one-hot", "distribution"])
def test_emitted_tokens_follow_the_target_distribution(proposal):
    torch.manual_seed(0)
    k, trials = 3, 100_000
    target_logits = torch.randn(k + 1, VOCAB) * 1.5
    target = target_logits.softmax(-1)
    q = (torch.randn(k, VOCAB) * 1.5).softmax(-1)  # the draft's proposals
    drafts = torch.multinomial(q, trials, replacement=True).T.reshape(-1)  # [trials * k]
    logits = target_logits.repeat(trials, 1)
    params = [SamplingParams(temperature=1.0)] * (trials * (k + 1))
    out = rejection_sample(logits, metadata(params), [k] * trials, drafts,
                           None if proposal == "one-hot" else q.repeat(trials, 1))
    tokens, emitted = out.token_ids, out.num_emitted
    assert bool(((emitted >= 1) & (emitted <= k + 1)).all())
    # Position j is reached in the trials that accepted j drafts; there it follows p_j.
    for j in range(k + 1):
        reached = emitted > j
        assert int(reached.sum()) > 2000  # enough trials reach every position
        counts = torch.bincount(tokens[reached, j], minlength=VOCAB).double()
        assert _chi_square_p(counts, target[j].double()) > 1e-3, j
    # And a sampler that ignored the target would be caught: the drafts' own law fails.
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB).double()
    assert _chi_square_p(counts, q[0].double()) < 1e-6


def test_acceptance_rate_is_the_overlap_of_target_and_proposal():
    torch.manual_seed(1)
    trials = 40_000
    target_logits = torch.randn(2, VOCAB)
    q = torch.randn(1, VOCAB).softmax(-1)
    drafts = torch.multinomial(q, trials, replacement=True).reshape(-1)
    out = rejection_sample(target_logits.repeat(trials, 1),
                           metadata([SamplingParams(temperature=1.0)] * (2 * trials)),
                           [1] * trials, drafts, q.repeat(trials, 1))
    rate = float((out.num_emitted == 2).double().mean())
    expected = float(torch.minimum(target_logits[0].softmax(-1), q[0]).sum())
    assert abs(rate - expected) < 0.015


def test_top_k_and_temperature_apply_to_the_verified_distribution():
    # top_k=1 makes every row greedy in effect: a draft other than the argmax never passes.
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.8, top_k=1)] * 2
    for _ in range(20):
        out = rejection_sample(logits, metadata(params), [1], torch.tensor([2]))
        assert out.token_ids.tolist() == [[1, -1]]


def test_seeded_rows_repeat_exactly():
    logits = torch.randn(8, VOCAB)
    drafts = torch.tensor([0, 1, 2, 3, 4, 0])

    def run(seed: int):
        gens = []
        for i in range(8):
            g = torch.Generator()
            g.manual_seed(seed * 100 + i)
            gens.append(g)
        md = metadata([SamplingParams(temperature=1.0, seed=seed)] * 8, gens)
        return rejection_sample(logits, md, [3, 3], drafts).token_ids.tolist()

    assert run(7) == run(7)
    assert any(run(7) != run(s) for s in range(8, 16))


def test_a_row_without_drafts_draws_what_the_plain_sampler_draws():
    # A seeded request's token must not depend on whether its step verified drafts.
    from vllmpy.sample.sampler import Sampler

    logits = torch.randn(1, VOCAB)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=5)]
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed)]
        plain = Sampler()(logits, metadata(params, gens))
        gens = [torch.Generator().manual_seed(seed)]
        spec = rejection_sample(logits, metadata(params, gens), [0],
                                torch.zeros(0, dtype=torch.int64))
        assert spec.token_ids.tolist() == [[int(plain[0])]]
