"""Sampler and SamplingMetadata against direct computations written out with loops."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from vllmpy.sample import Sampler, SamplingMetadata
from vllmpy.sample.sampler import (
    _apply_top_p_candidates,
    _apply_top_p_sorted,
    apply_logits_processors,
    apply_min_p,
    apply_top_k_top_p,
)
from vllmpy.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def build(params, vocab, prompts=None, outputs=None, generators=None, eos=None):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        eos if eos is not None else [set() for _ in range(n)],
        vocab,
        CPU,
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) if x != NEG_INF else 0.0 for x in row]
    total = sum(exps)
    return [e / total for e in exps]


def draw_many(logits_row: list[float], params: SamplingParams, n: int) -> Counter[int]:
    """Sample one row n times, each draw from its own seeded generator, in one batch."""
    logits = torch.tensor([logits_row] * n)
    md = build([params] * n, len(logits_row), generators=[gen(s) for s in range(n)])
    return Counter(Sampler()(logits, md).tolist())


# --- fast paths -------------------------------------------------------------------------

def test_plain_greedy_batch_sets_every_fast_path_flag():
    md = build([SamplingParams(temperature=0.0)] * 3, 10)
    assert md.all_greedy and not md.all_random
    assert md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p
    assert md.no_logit_bias and md.no_min_tokens
    assert md.temperature is None and md.greedy_mask is None
    assert md.prompt_token_ids is None and md.output_token_ids is None


def test_each_parameter_clears_its_own_flag_only():
    cases: dict[str, list[dict[str, Any]]] = {
        "no_penalties": [dict(repetition_penalty=1.2), dict(frequency_penalty=0.5),
                         dict(presence_penalty=-0.5)],
        "no_top_k": [dict(top_k=3)],
        "no_top_p": [dict(top_p=0.9)],
        "no_min_p": [dict(min_p=0.1)],
        "no_logit_bias": [dict(logit_bias={1: 2.0})],
        "no_min_tokens": [dict(min_tokens=2, stop_token_ids=[4])],
    }
    flags = list(cases)
    for flag, variants in cases.items():
        for kwargs in variants:
            md = build([SamplingParams(**kwargs)], 10, eos=[{9}])
            for other in flags:
                assert getattr(md, other) is (other != flag), (kwargs, other)
            assert md.all_random and not md.all_greedy


def test_filters_on_greedy_rows_are_ignored():
    # top-k, top-p and min-p do not change an argmax, so greedy rows never turn them on.
    md = build([SamplingParams(temperature=0.0, top_k=2, top_p=0.5, min_p=0.3)], 10)
    assert md.all_greedy and md.no_top_k and md.no_top_p and md.no_min_p


def test_top_k_disabled_values_and_max_top_k():
    md = build([SamplingParams(top_k=0), SamplingParams(top_k=3), SamplingParams(top_k=50),
                SamplingParams(top_k=-1), SamplingParams(top_k=5)], 20)
    assert md.top_k is not None
    assert md.top_k.tolist() == [20, 3, 20, 20, 5]
    assert md.max_top_k == 5


def test_min_tokens_is_off_once_reached():
    p = SamplingParams(min_tokens=2, stop_token_ids=[3])
    assert not build([p], 10, outputs=[[1]]).no_min_tokens
    assert build([p], 10, outputs=[[1, 2]]).no_min_tokens


# --- greedy --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = torch.randn(7, 33).to(dtype)
    before = logits.clone()
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 7, 33))
    assert out.dtype == torch.int64 and out.shape == (7,)
    rows = logits.float().tolist()
    assert out.tolist() == [row.index(max(row)) for row in rows]
    assert torch.equal(logits, before)


def test_tiny_temperature_is_greedy():
    md = build([SamplingParams(temperature=9e-6)], 5)
    assert md.all_greedy
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.9, -1.0]])
    assert Sampler()(logits, md).tolist() == [2]


# --- logit processors ----------------------------------------------------------------------

def expected_penalized(row, prompt, output, rep, freq, pres):
    out = []
    for t, x in enumerate(row):
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        x -= freq * output.count(t)
        if t in output:
            x -= pres
        out.append(x)
    return out


def test_penalties_match_loops():
    torch.manual_seed(1)
    vocab = 12
    logits = torch.randn(4, vocab) * 3
    logits[0, 5] = 0.0  # a zero logit stays zero under the repetition penalty
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.4, repetition_penalty=0.8),
        SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.3, presence_penalty=1.1),
    ]
    prompts = [[1, 2, 5, 5], [3], [0, 11, 7], [4, 4, 9]]
    outputs = [[2, 6], [3, 3, 8, 3], [7, 7, 2], [9, 10, 10, 1]]
    md = build(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_logits_processors(logits.clone(), md)
    for i, p in enumerate(params):
        want = expected_penalized(logits[i].tolist(), prompts[i], outputs[i],
                                  p.repetition_penalty, p.frequency_penalty,
                                  p.presence_penalty)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), i


def test_greedy_uses_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0, -2.0]])
    # Token 0 was generated twice: 5 - 2 * 1.5 = 2 < 4, so token 1 wins.
    md = build([SamplingParams(temperature=0.0, frequency_penalty=1.5)], 4,
               outputs=[[0, 0]])
    assert Sampler()(logits, md).tolist() == [1]


def test_prompt_tokens_only_feed_repetition_penalty():
    logits = torch.tensor([[2.0, 1.0, -1.0]])
    md = build([SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)], 3,
               prompts=[[0, 1, 2]], outputs=[[]])
    assert md.prompt_token_ids is None
    assert apply_logits_processors(logits, md).tolist() == [[2.0, 1.0, -1.0]]


def test_logit_bias_is_added():
    logits = torch.tensor([[0.5, 1.0, -2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(logit_bias={0: 10.0, 3: -100.0}), SamplingParams()]
    got = apply_logits_processors(logits, build(params, 4))
    assert got.tolist() == [[10.5, 1.0, -2.0, -97.0], [1.0, 1.0, 1.0, 1.0]]
    greedy = [SamplingParams(temperature=0.0, logit_bias={2: 5.0})] * 2
    assert Sampler()(logits, build(greedy, 4)).tolist() == [2, 2]


def test_logit_bias_out_of_vocab_is_refused():
    with pytest.raises(ValueError, match=r"logit_bias token ids \[7\]"):
        build([SamplingParams(logit_bias={7: 1.0})], 5)


def test_min_tokens_masks_stop_and_eos_until_reached():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]] * 4)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[0, 1], [0, 1, 2], [], []]
    eos = [{4}, {4}, {4}, {4}]
    md = build(params, 5, outputs=outputs, eos=eos)
    got = apply_logits_processors(logits, md).tolist()
    assert got[0] == [1.0, 2.0, 3.0, NEG_INF, NEG_INF]  # 2 outputs < 3: masked
    assert got[1] == [1.0, 2.0, 3.0, 4.0, 5.0]  # 3 outputs: released
    assert got[2] == [1.0, 2.0, 3.0, 4.0, NEG_INF]  # EOS masked even with ignore_eos (vLLM)
    assert got[3] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert Sampler()(logits, md).tolist() == [2, 4, 3, 4]


def test_min_tokens_ignores_ids_past_the_vocab():
    md = build([SamplingParams(min_tokens=1, stop_token_ids=[2, 99])], 4, eos=[{50}])
    assert md.min_tokens_index is not None
    assert md.min_tokens_index[1].tolist() == [2]


# --- filters -------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_best():
    row = [0.3, 2.0, -1.0, 1.5, 0.9, 1.7, 0.0, 1.2]  # distinct; top-3 = {1, 5, 3}
    counts = draw_many(row, SamplingParams(top_k=3), 3000)
    assert set(counts) == {1, 5, 3}
    probs = softmax([row[1], row[5], row[3]])
    for token, prob in zip([1, 5, 3], probs):
        assert counts[token] / 3000 == pytest.approx(prob, abs=0.04)


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    got = apply_top_k_top_p(logits, torch.tensor([2]), 2, None)
    assert got.tolist() == [[NEG_INF, 3.0, 2.0, 2.0, NEG_INF]]


def test_top_k_rows_without_top_k_keep_everything():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 2)
    got = apply_top_k_top_p(logits, torch.tensor([1, 4]), 1, None)
    assert got.tolist() == [[NEG_INF, 3.0, NEG_INF, NEG_INF], [1.0, 3.0, 2.0, 0.0]]


def expected_nucleus(probs: list[float], p: float) -> set[int]:
    """Most likely first (lower id first on ties); stop once the kept mass reaches p."""
    kept, mass = set(), 0.0
    for t in sorted(range(len(probs)), key=lambda t: (-probs[t], t)):
        if mass >= p:
            break
        kept.add(t)
        mass += probs[t]
    return kept


def top_p_via_sort(logits, top_p):
    return _apply_top_p_sorted(logits, top_p)


def top_p_via_candidates(logits, top_p):  # the CPU path: only the most likely tokens
    return apply_top_k_top_p(logits, None, logits.shape[1], top_p)


TOP_P_PATHS = [top_p_via_sort, top_p_via_candidates]


@pytest.mark.parametrize("top_p", TOP_P_PATHS)
@pytest.mark.parametrize("p", [0.2, 0.5, 0.6, 0.8, 0.95, 0.99])
def test_top_p_keeps_the_smallest_nucleus(top_p, p):
    row = [2.0, 1.0, 1.0, 0.0, -1.0]  # probs ~ .50 .18 .18 .07 .02: ties at 1 and 2
    got = top_p(torch.tensor([row]), torch.tensor([p]))
    kept = {t for t, x in enumerate(got[0].tolist()) if x != NEG_INF}
    assert kept == expected_nucleus(softmax(row), p)
    assert all(got[0, t] == row[t] for t in kept)


@pytest.mark.parametrize("top_p", TOP_P_PATHS)
def test_top_p_edge_cases(top_p):
    row = [5.0, 1.0, 0.0, 1.0]  # the top token alone holds ~0.96
    got = top_p(torch.tensor([row] * 3), torch.tensor([0.5, 0.97, 1.0]))
    assert got[0].tolist() == [5.0, NEG_INF, NEG_INF, NEG_INF]
    assert got[1].tolist() == [5.0, 1.0, NEG_INF, NEG_INF]  # tie 1 vs 3: lower id first
    assert got[2].tolist() == row  # p = 1 keeps everything


def test_top_p_paths_agree_on_a_large_vocabulary():
    torch.manual_seed(2)
    vocab = 5000
    # Peaked rows (nucleus among the top 1024), rows with many ties, a flat row.
    logits = torch.cat([torch.randn(4, vocab) * 4,
                        torch.randint(0, 6, (3, vocab)).float() * 2,
                        torch.randn(1, vocab) * 0.01])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.3, 0.6, 0.95, 0.5])
    want = top_p_via_sort(logits, top_p)
    assert torch.equal(top_p_via_candidates(logits, top_p), want)
    for i in range(len(top_p)):
        kept = {t for t, x in enumerate(want[i].tolist()) if x != NEG_INF}
        assert kept == expected_nucleus(softmax(logits[i].tolist()), float(top_p[i])), i
    # The flat row's nucleus reaches past the candidates: that path declines, the sort runs.
    assert _apply_top_p_candidates(logits[7:], top_p[7:]) is None
    assert _apply_top_p_candidates(logits[:4], top_p[:4]) is not None


def test_top_p_sampling_stays_in_the_nucleus():
    row = [0.1, 1.4, -0.3, 1.0, 0.8, -2.0]
    nucleus = expected_nucleus(softmax(row), 0.7)
    counts = draw_many(row, SamplingParams(top_p=0.7), 3000)
    assert set(counts) == nucleus and len(nucleus) == 3


def test_top_p_applies_to_the_top_k_survivors():
    row = [3.0, 2.0, 1.0, 0.0]
    top2 = softmax(row[:2])  # ~ .73 .27 after top-k=2
    assert top2[0] < 0.75
    got = apply_top_k_top_p(torch.tensor([row]), torch.tensor([2]), 2, torch.tensor([0.75]))
    assert got.tolist() == [[3.0, 2.0, NEG_INF, NEG_INF]]
    got = apply_top_k_top_p(torch.tensor([row]), torch.tensor([2]), 2, torch.tensor([0.7]))
    assert got.tolist() == [[3.0, NEG_INF, NEG_INF, NEG_INF]]


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.5, 1.0])
def test_min_p_matches_loop(min_p):
    row = [2.0, 1.5, 0.0, -1.25, 1.875, -3.0]
    got = apply_min_p(torch.tensor([row]), torch.tensor([min_p]))[0].tolist()
    probs = softmax(row)
    want = [x if probs[t] >= min_p * max(probs) else NEG_INF for t, x in enumerate(row)]
    assert got == want


def test_min_p_applies_after_temperature():
    row = [2.0, 1.0, 0.0]
    # At T = 1 token 1 has ~.37 of the top probability; at T = 0.5 only ~.14.
    for temperature, support in [(1.0, {0, 1}), (0.5, {0})]:
        counts = draw_many(row, SamplingParams(min_p=0.3, temperature=temperature), 1000)
        assert set(counts) == support


# --- random sampling -----------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    row = [1.0, 0.5, 0.0, -0.5, 2.0, -1.0]
    n = 20_000
    torch.manual_seed(1234)
    md = build([SamplingParams(temperature=temperature)] * n, len(row))
    counts = Counter(Sampler()(torch.tensor([row] * n), md).tolist())
    want = softmax([x / temperature for x in row])
    for t, prob in enumerate(want):
        # 4-sigma band of a binomial frequency, with a floor.
        tol = max(4 * math.sqrt(prob * (1 - prob) / n), 2e-3)
        assert counts[t] / n == pytest.approx(prob, abs=tol), (t, counts[t] / n, prob)


def seeded_run(rows: list[tuple[SamplingParams, torch.Generator | None]], logits: torch.Tensor,
               steps: int) -> list[list[int]]:
    sampler = Sampler()
    md = build([p for p, _ in rows], logits.shape[1], generators=[g for _, g in rows])
    return [sampler(logits, md).tolist() for _ in range(steps)]


def test_seeded_request_repeats_and_ignores_the_rest_of_the_batch():
    torch.manual_seed(0)
    vocab = 500
    mine = torch.randn(vocab)
    seeded = SamplingParams(seed=7, top_p=0.95)
    # Batch A: the seeded request first, next to an unseeded and a greedy request.
    logits_a = torch.stack([mine, torch.randn(vocab), torch.randn(vocab)])
    run_a = seeded_run([(seeded, gen(7)), (SamplingParams(), None),
                        (SamplingParams(temperature=0.0), gen(1))], logits_a, 6)
    # Batch B: other seeded requests first, different filters, the global RNG reseeded.
    torch.manual_seed(99)
    logits_b = torch.stack([torch.randn(vocab), torch.randn(vocab), mine])
    run_b = seeded_run([(SamplingParams(seed=7, top_k=5), gen(7)),
                        (SamplingParams(seed=8, min_p=0.1), gen(8)), (seeded, gen(7))],
                       logits_b, 6)
    tokens_a = [step[0] for step in run_a]
    tokens_b = [step[2] for step in run_b]
    assert tokens_a == tokens_b
    other_seed = seeded_run([(seeded, gen(8))], mine.unsqueeze(0), 6)
    assert [step[0] for step in other_seed] != tokens_a


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.zeros(4, 1000)
    md = build([SamplingParams()] * 4, 1000)
    torch.manual_seed(3)
    first = Sampler()(logits, md)
    torch.manual_seed(3)
    assert torch.equal(Sampler()(logits, md), first)


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(5)
    vocab = 64
    logits = torch.randn(6, vocab)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=1.3, top_k=1),  # random but forced to the argmax
        SamplingParams(temperature=0.0, logit_bias={10: 100.0}),
        SamplingParams(temperature=1.0, top_p=0.3, seed=2),
    ]
    outputs = [[], [], [int(logits[2].argmax())], [], [], []]
    generators = [None, gen(1), None, None, None, gen(2)]
    md = build(params, vocab, outputs=outputs, generators=generators)
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask is not None
    assert md.greedy_mask.tolist() == [True, False, True, False, True, False]
    out = Sampler()(logits, md).tolist()
    assert out[0] == int(logits[0].argmax())
    penalized = expected_penalized(logits[2].tolist(), [], outputs[2], 2.0, 0.0, 0.0)
    assert out[2] == max(range(vocab), key=lambda t: penalized[t])
    assert out[3] == int(logits[3].argmax())
    assert out[4] == 10
    # Seeded random rows draw what they would draw alone.
    for row, seed in ((1, 1), (5, 2)):
        alone = build([params[row]], vocab, generators=[gen(seed)])
        assert out[row] == Sampler()(logits[row:row + 1], alone).item()
    nucleus = expected_nucleus(softmax(logits[5].tolist()), 0.3)
    assert out[5] in nucleus


def test_input_logits_are_not_modified():
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, logit_bias={1: 3.0}, top_k=4, top_p=0.8,
                             min_p=0.1, min_tokens=2, stop_token_ids=[0]),
              SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=0.7)]
    md = build(params, 20, prompts=[[1, 2]] * 3, outputs=[[3]] * 3)
    Sampler()(logits, md)
    assert torch.equal(logits, before)


def test_shape_mismatch_is_refused():
    md = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(3, 10), md)
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 11), md)


def test_build_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="output_token_ids has 1 entries for 2 requests"):
        SamplingMetadata.build([SamplingParams()] * 2, [[], []], [[]], [None, None],
                               [set(), set()], 10, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sampling_never_waits_for_the_host():
    device = torch.device("cuda")
    vocab = 32_000
    torch.manual_seed(0)
    logits = (torch.randn(6, vocab) * 3).to(device, torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 1.0}),
        SamplingParams(seed=3, top_k=40, top_p=0.9, min_p=0.05, frequency_penalty=0.4),
        SamplingParams(top_p=0.8, presence_penalty=0.3, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=4, temperature=1.5),
    ]

    def run():
        generators = [torch.Generator(device).manual_seed(p.seed) if p.seed else None
                      for p in params]
        md = SamplingMetadata.build(params, [[1, 2, 3]] * 6, [[4, 5]] * 6, generators,
                                    [{2}] * 6, vocab, device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = Sampler()(logits, md)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out.tolist()

    first, second = run(), run()
    assert first[1] == second[1] and first[5] == second[5]
    for row in (3, 4):  # top_k=1 and greedy: a largest logit (bf16 values can tie)
        assert logits[row, first[row]] == logits[row].max()
    cpu_md = build([p for p in params], vocab, prompts=[[1, 2, 3]] * 6, outputs=[[4, 5]] * 6,
                   eos=[{2}] * 6)
    assert first[0] == Sampler()(logits.cpu(), cpu_md)[0].item()
