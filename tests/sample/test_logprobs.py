"""Logprobs math against a plain reference: full sorts and log-softmax written out in Python."""

from __future__ import annotations

import math

import pytest
import torch

from vllmpy.core.sched_output import LogprobsLists
from vllmpy.sample import Sampler, SamplingMetadata
from vllmpy.sample.logprobs import (
    LogprobsSpec,
    PromptChunk,
    PromptLogprobsPlan,
    gather_logprobs,
    logprobs_values,
    sampled_logprobs,
)
from vllmpy.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = sum(math.exp(x - top) for x in row if x != NEG_INF)
    return [x - top - math.log(total) if x != NEG_INF else NEG_INF for x in row]


def rank(row: list[float], token: int) -> int:
    """1-based rank from a full descending sort: the first place holding the token's value."""
    ordered = sorted(row, reverse=True)
    return ordered.index(row[token]) + 1


def top_ids(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda t: -row[t])[:k]


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rounded to a coarse grid so that rows carry ties.
    return (torch.randn(rows, vocab, generator=g) * 4).round() / 2


def spec(num_top, modes=None, token_ids=None) -> LogprobsSpec:
    n = len(num_top)
    return LogprobsSpec(list(num_top), modes or ["raw_logprobs"] * n,
                        token_ids or [[] for _ in range(n)])


# ---- gather_logprobs ------------------------------------------------------------------


def test_scored_token_value_and_rank_match_a_full_sort():
    logits = random_logits(6, 40, seed=0)
    targets = torch.tensor([0, 5, 39, 17, 3, 22])
    sp = spec([0, 1, 3, 5, 40, 2])
    values = logprobs_values(logits, None, sp.modes)
    out = gather_logprobs(values, targets, sp).to_lists(sp)
    for r, row in enumerate(logits.tolist()):
        ref = log_softmax(row)
        t = int(targets[r])
        assert out.token_ids[r][0] == t
        assert out.logprobs[r][0] == pytest.approx(ref[t], abs=1e-5)
        assert out.ranks[r][0] == rank(row, t)
        assert len(out.token_ids[r]) == 1 + sp.num_top[r]


def test_top_alternatives_are_the_most_likely_with_their_ranks():
    logits = random_logits(4, 30, seed=1)
    sp = spec([5, 1, 30, 0])
    out = gather_logprobs(logprobs_values(logits, None, sp.modes), torch.zeros(4, dtype=torch.long),
                          sp).to_lists(sp)
    for r, row in enumerate(logits.tolist()):
        ref = log_softmax(row)
        ids, lps, ranks = out.token_ids[r][1:], out.logprobs[r][1:], out.ranks[r][1:]
        k = sp.num_top[r]
        # the same values as the k best of a full sort (ties may pick other ids)
        assert sorted(lps, reverse=True) == pytest.approx(
            [ref[t] for t in top_ids(row, k)], abs=1e-5)
        for t, lp, rk in zip(ids, lps, ranks):
            assert lp == pytest.approx(ref[t], abs=1e-5)
            assert rk == rank(row, t)


def test_tied_tokens_share_a_rank():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    sp = spec([5])
    out = gather_logprobs(logprobs_values(logits, None, sp.modes), torch.tensor([3]),
                          sp).to_lists(sp)
    assert out.ranks[0][0] == 4  # three tokens above token 3
    by_id = dict(zip(out.token_ids[0][1:], out.ranks[0][1:]))
    assert by_id == {1: 1, 2: 1, 4: 1, 3: 4, 0: 5}


def test_listed_ids_replace_the_top_and_rank_over_the_vocabulary():
    logits = random_logits(3, 50, seed=2)
    listed = [[7, 3, 49], [], [0]]
    sp = spec([3, 2, 1], token_ids=listed)
    targets = torch.tensor([11, 12, 13])
    out = gather_logprobs(logprobs_values(logits, None, sp.modes), targets, sp).to_lists(sp)
    for r, row in enumerate(logits.tolist()):
        ref = log_softmax(row)
        assert out.ranks[r][0] == rank(row, int(targets[r]))
        if listed[r]:
            assert out.token_ids[r][1:] == listed[r]
            for t, lp, rk in zip(listed[r], out.logprobs[r][1:], out.ranks[r][1:]):
                assert lp == pytest.approx(ref[t], abs=1e-5)
                assert rk == rank(row, t)
        else:
            assert sorted(out.token_ids[r][1:]) == sorted(top_ids(row, 2))


def test_mismatched_shapes_are_refused():
    sp = spec([1, 1])
    with pytest.raises(ValueError, match="do not match 2 rows"):
        gather_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), sp)
    with pytest.raises(ValueError, match="differ in length"):
        LogprobsSpec([1], ["raw_logprobs", "raw_logits"], [[]])
    with pytest.raises(ValueError, match="unknown logprobs modes"):
        LogprobsSpec([1], ["logits"], [[]])


# ---- modes ----------------------------------------------------------------------------


def test_modes_pick_raw_or_processed_rows_as_logprobs_or_logits():
    raw = random_logits(4, 12, seed=3)
    processed = raw / 0.5
    processed[:, :4] = NEG_INF
    modes = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
    values = logprobs_values(raw.to(torch.bfloat16).float(), processed, modes)
    raw_rows, proc_rows = raw.tolist(), processed.tolist()
    assert values[0].tolist() == pytest.approx(log_softmax(raw_rows[0]), abs=1e-5)
    assert values[1].tolist() == pytest.approx(raw_rows[1])
    assert values[2].tolist() == pytest.approx(log_softmax(proc_rows[2]), abs=1e-5)
    assert values[3].tolist() == pytest.approx(proc_rows[3])
    with pytest.raises(ValueError, match="processed logits"):
        logprobs_values(raw, None, ["processed_logits"] * 4)


def test_processed_logprobs_describe_the_distribution_sampled():
    """top-k and temperature shape what processed modes report; raw modes ignore them."""
    logits = random_logits(2, 20, seed=4)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=2,
                             logprobs_mode="processed_logprobs"),
              SamplingParams(temperature=0.5, top_k=3, logprobs=2)]
    md = SamplingMetadata.build(params, [[], []], [[], []], [None, None], [set(), set()],
                                20, CPU)
    sampled, processed = Sampler().sample(logits, md)
    lp = sampled_logprobs(params, logits, processed, sampled)
    assert lp is not None
    rows = lp.to_lists()
    for r, row in enumerate(logits.tolist()):
        if r == 0:
            kth = sorted(row, reverse=True)[2]
            ref = log_softmax([x / 0.5 if x >= kth else NEG_INF for x in row])
        else:
            ref = log_softmax(row)
        got = rows[r]
        assert got is not None
        t = int(sampled[r])
        assert got.token_ids[0][0] == t
        assert got.logprobs[0][0] == pytest.approx(ref[t], abs=1e-5)
        for tok, value in zip(got.token_ids[0][1:], got.logprobs[0][1:]):
            assert value == pytest.approx(ref[tok], abs=1e-5)


def test_greedy_fast_path_hands_back_the_logits():
    logits = random_logits(2, 9, seed=5)
    md = SamplingMetadata.build([SamplingParams(temperature=0.0)] * 2, [[], []], [[], []],
                                [None, None], [set(), set()], 9, CPU)
    sampled, processed = Sampler().sample(logits, md)
    assert torch.equal(processed, logits)
    assert sampled.tolist() == logits.argmax(dim=-1).tolist()


def test_sampled_logprobs_only_for_rows_that_ask():
    logits = random_logits(3, 16, seed=6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=-1),
              SamplingParams(temperature=0.0, logprob_token_ids=[4, 9])]
    assert sampled_logprobs(params[:1], logits[:1], None, torch.tensor([0])) is None
    sampled = logits.argmax(dim=-1)
    lp = sampled_logprobs(params, logits, None, sampled)
    assert lp is not None
    rows = lp.to_lists()
    assert rows[0] is None
    whole, listed = rows[1], rows[2]
    assert whole is not None and listed is not None
    assert len(whole.token_ids[0]) == 1 + 16 and sorted(whole.token_ids[0][1:]) == list(range(16))
    assert listed.token_ids[0] == [int(sampled[2]), 4, 9]
    assert whole.ranks[0][0] == 1 and listed.ranks[0][0] == 1


def test_listed_ids_outside_the_vocabulary_are_dropped():
    sp = LogprobsSpec.for_sampled([SamplingParams(logprob_token_ids=[2, 99])], 10)
    assert sp.token_ids == [[2]] and sp.width(0) == 1


# ---- prompt positions -----------------------------------------------------------------


def test_prompt_plan_scores_each_position_against_the_next_prompt_token():
    vocab = 24
    prompt_a = [3, 7, 1, 9, 4, 20]
    prompt_b = [5, 2]
    # one step: request a's middle chunk [2, 5), request b's whole prompt, request c's
    # last token only (nothing to score)
    chunks = [PromptChunk("a", prompt_a, 2, start=2, end=5, first_row=0),
              PromptChunk("b", prompt_b, 0, start=0, end=2, first_row=3),
              PromptChunk("c", [1, 2, 3], 1, start=2, end=3, first_row=5)]
    plan = PromptLogprobsPlan.build(chunks)
    assert plan is not None
    assert plan.spans == [("a", 3, 3), ("b", 1, 1)]
    hidden = random_logits(6, vocab, seed=7)  # the "hidden states" are the logits here
    out = plan.run(hidden, lambda h: h, vocab)
    assert set(out) == {"a", "b"}
    a, b = out["a"], out["b"]
    assert isinstance(a, LogprobsLists) and a.start == 3 and len(a) == 3
    for i, pos in enumerate(range(2, 5)):
        row = hidden[pos - 2].tolist()
        target = prompt_a[pos + 1]
        assert a.token_ids[i][0] == target
        assert a.logprobs[i][0] == pytest.approx(log_softmax(row)[target], abs=1e-5)
        assert a.ranks[i][0] == rank(row, target)
        assert len(a.token_ids[i]) == 3
    assert b.start == 1 and b.token_ids == [[2]] and len(b.ranks[0]) == 1
    assert PromptLogprobsPlan.build(chunks[2:]) is None


def test_prompt_plan_slices_many_rows(monkeypatch):
    import vllmpy.sample.logprobs as mod

    monkeypatch.setattr(mod, "PROMPT_LOGITS_ROWS", 4)
    prompt = list(range(11))
    plan = PromptLogprobsPlan.build([PromptChunk("r", prompt, -1, 0, 11, 0)])
    assert plan is not None
    hidden = random_logits(11, 12, seed=8)
    calls: list[int] = []

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h

    out = plan.run(hidden, logits_of, 12)["r"]
    assert calls == [4, 4, 2] and len(out) == 10
    assert all(len(ids) == 13 for ids in out.token_ids)  # -1: the whole vocabulary
    for p in range(10):
        assert out.logprobs[p][0] == pytest.approx(
            log_softmax(hidden[p].tolist())[prompt[p + 1]], abs=1e-5)


# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, needle", [
    ({"logprobs": -2}, "logprobs must be an integer >= 0, or -1"),
    ({"prompt_logprobs": -5}, "prompt_logprobs must be an integer >= 0, or -1"),
    ({"prompt_logprobs": "3"}, "prompt_logprobs must be an integer"),
    ({"logprobs": True}, "logprobs must be an integer"),
    ({"logprobs": 1.5}, "logprobs must be an integer"),
    ({"logprobs_mode": "logits"}, "logprobs_mode must be one of"),
    ({"logprob_token_ids": []}, "non-empty list"),
    ({"logprob_token_ids": [1, -1]}, "non-empty list of token ids >= 0"),
    ({"logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))}, "at most 128"),
    ({"logprob_token_ids": [1, 2], "logprobs": 3}, "must be unset or equal"),
])
def test_sampling_params_refuse_bad_logprobs_fields(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_accept_logprobs_fields():
    p = SamplingParams(logprobs=-1, prompt_logprobs=0, logprobs_mode="processed_logits")
    assert (p.logprobs, p.prompt_logprobs, p.logprobs_mode) == (-1, 0, "processed_logits")
    assert SamplingParams(logprob_token_ids=[1, 2], logprobs=2).logprob_token_ids == [1, 2]


# ---- from the device's lists to vLLM's Logprob dicts (the frontend) ---------------------


class _Tokenizer:
    """Each id decodes to "<id>"; enough for the output processor."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def _lists(rows, start=0) -> LogprobsLists:
    """rows: [(token ids, logprobs, ranks)] per position."""
    return LogprobsLists([list(r[0]) for r in rows], [list(r[1]) for r in rows],
                         [list(r[2]) for r in rows], start)


def _processor(kind, **params):
    from vllmpy.engine.output_processor import OutputProcessor
    from vllmpy.sampling_params import RequestOutputKind

    proc = OutputProcessor(_Tokenizer())
    sp = SamplingParams(output_kind=RequestOutputKind[kind], **params)
    proc.add_request("r", None, [5, 6, 7, 8], [sp])
    return proc


def _core(tokens, logprobs=None, prompt=None, finish=None):
    from vllmpy.core.sched_output import EngineCoreOutput

    return EngineCoreOutput("r", tokens, finish_reason=finish, new_logprobs=logprobs,
                            new_prompt_logprobs=prompt)


def test_output_processor_builds_prompt_and_sample_logprobs():
    from vllmpy.outputs import Logprob

    proc = _processor("FINAL_ONLY", logprobs=1, prompt_logprobs=1)
    # a prefill chunk scoring prompt tokens 1 and 2 hands nothing out
    chunk1 = _lists([([6, 9], [-1.5, -0.5], [2, 1]), ([7], [-0.25], [1])], start=1)
    assert proc.process_outputs([_core([], prompt=chunk1)]) == ([], [])
    chunk2 = _lists([([8, 8], [-2.0, -2.0], [1, 1])], start=3)
    first = _lists([([11, 12], [-0.75, -0.5], [2, 1])])
    assert proc.process_outputs([_core([11], first, chunk2)]) == ([], [])
    final, _ = proc.process_outputs([_core([13], _lists([([13], [-0.125], [1])]),
                                           finish="length")])
    out = final[0]
    assert out.prompt_logprobs == [
        None,
        {6: Logprob(-1.5, 2, "<6>"), 9: Logprob(-0.5, 1, "<9>")},
        {7: Logprob(-0.25, 1, "<7>")},
        {8: Logprob(-2.0, 1, "<8>")},  # the scored token was also the top one
    ]
    c = out.outputs[0]
    assert c.token_ids == [11, 13]
    assert c.logprobs == [{11: Logprob(-0.75, 2, "<11>"), 12: Logprob(-0.5, 1, "<12>")},
                          {13: Logprob(-0.125, 1, "<13>")}]
    assert c.cumulative_logprob == pytest.approx(-0.875)


def test_output_processor_deltas_carry_their_own_logprobs():
    proc = _processor("DELTA", logprobs=0, prompt_logprobs=0, detokenize=False)
    prompt = _lists([([6], [-1.0], [3]), ([7], [-2.0], [4]), ([8], [-3.0], [5])], start=1)
    outs, _ = proc.process_outputs([_core([11], _lists([([11], [-0.5], [1])]), prompt)])
    first = outs[0]
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 4
    assert first.prompt_logprobs[3][8].decoded_token is None  # not detokenized
    assert [list(d) for d in first.outputs[0].logprobs] == [[11]]
    outs, _ = proc.process_outputs([_core([12, 13], _lists([([12], [-0.25], [1]),
                                                            ([13], [-0.125], [2])]))])
    second = outs[0]
    assert second.prompt_logprobs is None  # a stream carries them once
    assert [list(d) for d in second.outputs[0].logprobs] == [[12], [13]]
    assert second.outputs[0].cumulative_logprob == pytest.approx(-0.875)


def test_output_processor_without_logprobs_leaves_them_unset():
    proc = _processor("FINAL_ONLY")
    outs, _ = proc.process_outputs([_core([11], finish="length")])
    assert outs[0].prompt_logprobs is None
    assert outs[0].outputs[0].logprobs is None and outs[0].outputs[0].cumulative_logprob is None


def test_logprobs_lists_head_keeps_the_first_rows():
    lists = _lists([([1], [-1.0], [1]), ([2], [-2.0], [2])], start=4)
    head = lists.head(1)
    assert (head.token_ids, head.logprobs, head.ranks, head.start) == ([[1]], [[-1.0]], [[1]], 4)
