"""The scheduler's structured-output duties, with a fake grammar manager: requests wait
while their grammar compiles without holding others back, the step's bitmask has a row
for each grammar request that samples, sampled tokens reach the matcher, and jump-forward
tokens reach the output and the runner."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from vllmpy.core.kv_cache_manager import KVCacheManager
from vllmpy.core.request import Request, RequestStatus
from vllmpy.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vllmpy.core.scheduler import GRAMMAR_WAIT_S, Scheduler
from vllmpy.sampling_params import SamplingParams, StructuredOutputsParams
from vllmpy.structured_output.request import GrammarCompileError

WORDS = 3  # bitmask words per row in these tests


class FakeGrammar:
    """Stands in for a StructuredOutputRequest."""

    def __init__(self, marker: int) -> None:
        self.marker = marker  # what its bitmask row is filled with
        self.compilation: Future[None] = Future()
        self.accepted: list[int] = []
        self.jumps: list[list[int]] = []  # what each jump_forward_tokens call returns

    def ready(self) -> bool:
        if not self.compilation.done():
            return False
        if self.compilation.exception() is not None:
            raise GrammarCompileError(str(self.compilation.exception()))
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        self.accepted.extend(token_ids)
        return True


class FakeManager:
    def __init__(self) -> None:
        self.waits: list[tuple[list[FakeGrammar], float]] = []
        self.limits: list[int] = []

    def grammar_bitmask(self, requests: list[FakeGrammar]) -> np.ndarray:
        assert all(r.ready() for r in requests)
        return np.array([[r.marker] * WORDS for r in requests], dtype=np.int32)

    def jump_forward_tokens(self, request: FakeGrammar, limit: int) -> list[int]:
        self.limits.append(limit)
        return request.jumps.pop(0)[:limit] if request.jumps else []

    def wait_for_any(self, requests: list[FakeGrammar], timeout: float) -> None:
        self.waits.append((list(requests), timeout))


def make(budget: int = 64) -> tuple[Scheduler, FakeManager]:
    manager = FakeManager()
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=budget,
                      max_model_len=128, structured_output_manager=manager)  # type: ignore[arg-type]
    return sched, manager


def request(req_id: str, prompt_len: int, grammar: FakeGrammar | None = None,
            max_tokens: int = 16, **params) -> Request:
    sp = SamplingParams(**params)
    if grammar is not None:
        sp.structured_outputs = StructuredOutputsParams(regex="a+")
    r = Request(req_id, list(range(1, prompt_len + 1)), sp, {0}, max_tokens, 0.0)
    r.structured_output_request = grammar
    return r


def sample(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    """A runner output sampling ``tokens[req_id]`` for every scheduled request."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[tokens.get(r, 99)] for r in ids])


def test_a_compiling_grammar_waits_without_holding_back_the_queue():
    sched, manager = make()
    g = FakeGrammar(marker=5)
    sched.add_request(request("g", 4, g))
    sched.add_request(request("p", 4))
    assert sched.requests["g"].status == RequestStatus.WAITING_FOR_FSM
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["p"]
    assert so.grammar_bitmask is None and so.structured_output_request_ids == {}
    assert [r.request_id for r in sched.waiting] == ["g"]
    assert manager.waits == []  # p ran: no waiting
    sched.update_from_output(so, sample(so, {}))

    g.compilation.set_result(None)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p": 1, "g": 4}
    assert sched.requests["g"].status == RequestStatus.RUNNING
    assert so.structured_output_request_ids == {"g": 0}
    assert so.grammar_bitmask is not None
    assert so.grammar_bitmask.tolist() == [[5] * WORDS]
    outs = sched.update_from_output(so, sample(so, {"g": 42}))
    assert g.accepted == [42]
    assert [o.new_token_ids for o in outs if o.req_id == "g"] == [[42]]


def test_only_compiling_grammars_make_an_empty_step_that_waits_for_them():
    sched, manager = make()
    g = FakeGrammar(marker=1)
    sched.add_request(request("g", 4, g))
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0
    assert manager.waits == [([g], GRAMMAR_WAIT_S)]


def test_priority_order_is_kept_for_requests_passed_over():
    manager = FakeManager()
    sched = Scheduler(KVCacheManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64,
                      max_model_len=128, structured_output_manager=manager)  # type: ignore[arg-type]
    g = FakeGrammar(marker=1)
    for r in (request("a", 4), request("g", 4, g), request("b", 4)):
        sched.add_request(r)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["a"]  # one seat
    assert [r.request_id for r in sched.waiting] == ["g", "b"]


def test_a_failed_grammar_fails_its_request_with_the_reason():
    sched, _ = make()
    g = FakeGrammar(marker=1)
    sched.add_request(request("g", 4, g))
    g.compilation.set_exception(ValueError("invalid regex: nope"))
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0
    outs = sched.update_from_output(so, sample(so, {}))
    assert [(o.req_id, o.finish_reason) for o in outs] == [("g", "error")]
    assert outs[0].error is not None and "invalid regex: nope" in outs[0].error
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


def test_a_chunk_that_does_not_sample_gets_no_bitmask_row():
    sched, _ = make(budget=6)
    g, h = FakeGrammar(marker=1), FakeGrammar(marker=2)
    g.compilation.set_result(None)
    h.compilation.set_result(None)
    sched.add_request(request("g", 4, g))
    sched.add_request(request("h", 7, h))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"g": 4, "h": 2}  # h is mid-prefill
    assert so.structured_output_request_ids == {"g": 0}
    sched.update_from_output(so, sample(so, {"g": 7, "h": 8}))
    assert g.accepted == [7] and h.accepted == []  # a mid-prefill sample is discarded
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"g": 1, "h": 5}
    assert so.structured_output_request_ids == {"g": 0, "h": 1}
    assert so.grammar_bitmask is not None and so.grammar_bitmask[:, 0].tolist() == [1, 2]


def test_jump_forward_tokens_join_the_output_and_reach_the_runner():
    sched, manager = make()
    g = FakeGrammar(marker=1)
    g.compilation.set_result(None)
    g.jumps = [[7, 8, 9]]
    sched.add_request(request("g", 4, g, max_tokens=10))
    so = sched.schedule()
    outs = sched.update_from_output(so, sample(so, {"g": 42}))
    assert outs[0].new_token_ids == [42, 7, 8, 9]
    assert g.accepted == [42]  # the manager's matcher accepted the jumped ones itself
    assert manager.limits == [9]
    req = sched.requests["g"]
    assert req.output_token_ids == [42, 7, 8, 9] and req.num_computed_tokens == 4
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"g": 4}  # the sampled token plus the jumped ones
    assert so.scheduled_cached_reqs.new_token_ids == [[7, 8, 9]]
    assert so.structured_output_request_ids == {"g": 0}
    sched.update_from_output(so, sample(so, {"g": 43}))
    so = sched.schedule()
    assert so.scheduled_cached_reqs.new_token_ids == [[]]  # sent once


def test_jump_forward_stops_at_max_tokens():
    sched, manager = make()
    g = FakeGrammar(marker=1)
    g.compilation.set_result(None)
    g.jumps = [[7, 8, 9]]
    sched.add_request(request("g", 4, g, max_tokens=3))
    so = sched.schedule()
    outs = sched.update_from_output(so, sample(so, {"g": 42}))
    assert manager.limits == [2]
    assert outs[0].new_token_ids == [42, 7, 8] and outs[0].finish_reason == "length"
    assert not sched.has_unfinished_requests()


def test_requests_with_logprobs_are_not_jumped():
    sched, manager = make()
    g = FakeGrammar(marker=1)
    g.compilation.set_result(None)
    g.jumps = [[7]]
    sched.add_request(request("g", 4, g, logprobs=1))
    so = sched.schedule()
    outs = sched.update_from_output(so, sample(so, {"g": 42}))
    assert outs[0].new_token_ids == [42] and manager.limits == []
