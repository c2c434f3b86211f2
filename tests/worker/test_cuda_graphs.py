"""CUDA graphs for decode steps and small mixed steps: which sizes are captured, and on a
GPU the same tokens and logprobs as the eager forward, for every kind of step."""

from __future__ import annotations

import pytest
import torch
from models.test_tiny_models import COMMON, _make, _prompts

from vllmpy import LLM, SamplingParams
from vllmpy.worker.cuda_graphs import MIXED_TOKEN_SIZES, capture_sizes, mixed_capture_sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_decode_sizes_cover_every_batch_up_to_max_num_seqs():
    for max_num_seqs in (1, 3, 8, 20, 256):
        sizes = capture_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs
        for n in range(1, max_num_seqs + 1):  # some size holds every batch
            assert any(s >= n for s in sizes)


def test_mixed_sizes_stop_at_the_step_budget():
    assert mixed_capture_sizes(8192) == list(MIXED_TOKEN_SIZES)
    assert mixed_capture_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(16) == [16]
    assert mixed_capture_sizes(7) == [7]


def test_start_up_prefills_keep_every_position_inside_the_serving_length(tmp_path):
    # The profile and kernel-recording forwards run one step of the whole token budget;
    # a budget past max_model_len (8192 against the model's 512 positions) is split into
    # fresh sequences the scheduler could send, so rotary never indexes past its table.
    _make("qwen3", tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=16, num_blocks=64, max_num_batched_tokens=8192)
    runner = llm.engine.engine_core.model_runner
    for tokens in (8192, 2048, 1000, 512, 7):
        lens = runner._fresh_seq_lens(tokens)
        assert sum(lens) == tokens and all(0 < n <= 512 for n in lens)
    assert runner._fresh_seq_lens(1000) == [512, 488]


@cuda
def test_a_second_engine_in_one_process_starts_with_a_budget_past_the_serving_length(
        tmp_path):
    # The second engine's start-up launches, for real, the variants the first compiled
    # (kernel recording skips only uncompiled ones), and without --num-blocks the memory
    # profile runs the whole budget as well.
    _make("qwen3", tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(4, COMMON["vocab_size"], seed=3)
    outs = []
    for _ in range(2):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cuda", dtype="float32",
                  block_size=16, max_num_batched_tokens=8192, gpu_memory_utilization=0.2)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)])
        del llm
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0])


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    _make(request.param, path)
    return str(path)


def _run(path: str, eager: bool, prompts, params, **kw):
    llm = LLM(path, skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=16,
              num_blocks=256, enforce_eager=eager, **kw)
    graphs = llm.engine.engine_core.model_runner.graphs
    assert (graphs is None) == eager
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm


@cuda
@pytest.mark.parametrize("budget", [8192, 24, 7])
def test_graph_steps_match_eager_steps(tiny, budget):
    """Prompts sharing a cached prefix (chunks that attend to cached keys), decodes beside
    prefill chunks, chunking at small step budgets: every step kind through the graphs
    gives the eager forward's greedy tokens and logprobs."""
    base = _prompts(12, COMMON["vocab_size"], seed=7)
    shared = base[0] * 3  # a long common prefix, so later prompts hit the prefix cache
    prompts = [shared + p for p in base[:6]] + base[6:]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    eager, _ = _run(tiny, True, prompts, params, max_num_batched_tokens=budget)
    graph, llm = _run(tiny, False, prompts, params, max_num_batched_tokens=budget)
    assert [o.token_ids for o in graph] == [o.token_ids for o in eager]
    for g, e in zip(graph, eager):
        for g_step, e_step in zip(g.logprobs, e.logprobs):
            assert g_step.keys() == e_step.keys()
            for tok in g_step:
                assert g_step[tok].logprob == pytest.approx(e_step[tok].logprob, abs=1e-4)
    graphs = llm.engine.engine_core.model_runner.graphs
    assert graphs.mixed_sizes == mixed_capture_sizes(budget)


@cuda
def test_a_cached_prefix_hit_replays_a_mixed_graph(tiny):
    """The second request reuses the first one's blocks: only its new tokens are computed,
    in one mixed-graph step, and its tokens equal the cold run's."""
    prompt = _prompts(1, COMMON["vocab_size"], seed=9)[0] * 4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(tiny, skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=16,
              num_blocks=256)
    cold = llm.generate([prompt], params, use_tqdm=False)[0]
    runner = llm.engine.engine_core.model_runner
    replays = []
    original = runner.graphs.run_mixed

    def spy(num_tokens, *args, **kw):
        replays.append(num_tokens)
        return original(num_tokens, *args, **kw)

    runner.graphs.run_mixed = spy
    warm = llm.generate([prompt], params, use_tqdm=False)[0]
    assert warm.num_cached_tokens > 0
    assert replays == [len(prompt) - warm.num_cached_tokens]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


def _launch_events(llm) -> list[str]:
    """Spies on the runner: 'replay' for each decode-graph replay, 'sample' for each
    sampler call, in order (a step's replay comes before its sampler call, if any)."""
    runner = llm.engine.engine_core.model_runner
    events: list[str] = []
    run, sample = runner.graphs.run, runner.sampler.sample

    def spy_run(*a, **kw):
        events.append("replay")
        return run(*a, **kw)

    def spy_sample(*a, **kw):
        events.append("sample")
        return sample(*a, **kw)

    runner.graphs.run = spy_run
    runner.sampler.sample = spy_sample
    return events


@cuda
@pytest.mark.parametrize("other", ["greedy", "seeded", "penalty"])
def test_greedy_decode_steps_take_the_graphs_argmax(tiny, other):
    """A decode step whose requests all sample greedily, with nothing that changes their
    logits, takes the decode graph's own argmax and calls no sampler; one with a seeded
    random request or a repetition penalty beside them runs the sampler over the graph's
    logits. Both give the eager engine's tokens."""
    prompts = _prompts(4, COMMON["vocab_size"], seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    last = {"greedy": greedy,
            "seeded": SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
            "penalty": SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=12,
                                      ignore_eos=True)}[other]
    params = [greedy] * 3 + [last]
    eager, _ = _run(tiny, True, prompts, params)
    llm = LLM(tiny, skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=16,
              num_blocks=256)
    events = _launch_events(llm)
    graph = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in graph] == [o.token_ids for o in eager]
    replays = [i for i, e in enumerate(events) if e == "replay"]
    assert len(replays) >= 10  # the decode steps went through the graphs
    followed = [i + 1 < len(events) and events[i + 1] == "sample" for i in replays]
    if other == "greedy":
        assert not any(followed)
    else:
        assert all(followed)


@cuda
def test_decode_steps_copy_the_block_table_only_when_it_changes(tiny):
    """A request's block table changes when it gets a new block (every block_size tokens):
    the decode steps in between copy no table to the device, and the tokens stay the eager
    engine's, also when mixed steps (whose tables differ) come between decodes."""
    prompt = _prompts(1, COMMON["vocab_size"], seed=13)[0][:5]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    eager, _ = _run(tiny, True, [prompt], params)
    llm = LLM(tiny, skip_tokenizer_init=True, device="cuda", dtype="float32", block_size=16,
              num_blocks=256)
    buffers = llm.engine.engine_core.model_runner.buffers
    stage, copies = buffers.stage, []

    def spy(*a, **kw):
        before = buffers._tables
        out = stage(*a, **kw)
        if kw.get("decode"):  # the decode steps' staging
            copies.append(buffers._tables is not before)
        return out

    buffers.stage = spy
    graph = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert graph.token_ids == eager[0].token_ids
    # 59 decode steps over positions 5..63: the first copies, then one copy per new block
    # (at positions 16, 32 and 48)
    assert len(copies) >= 50 and sum(copies) == 4, copies
    # a mixed step in between: the next decode step copies again
    many = _prompts(3, COMMON["vocab_size"], seed=14)
    both = llm.generate([prompt] + many, params, use_tqdm=False)
    ref, _ = _run(tiny, True, [prompt] + many, params)
    assert [o.outputs[0].token_ids for o in both] == [o.token_ids for o in ref]
