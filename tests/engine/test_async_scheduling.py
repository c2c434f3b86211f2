"""Async scheduling (step N+1 launched before step N's ids are read) gives exactly the
tokens of one-step-at-a-time scheduling, whatever the batch does in between."""

from __future__ import annotations

import pytest
import torch
from models.test_tiny_models import COMMON, _make, _prompts

from vllmpy import LLM, SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    _make("qwen3", path)
    return str(path)


def run(path: str, device: str, async_scheduling: bool, prompts, params, **kw):
    llm = LLM(path, skip_tokenizer_init=True, device=device, dtype="float32",
              block_size=16, async_scheduling=async_scheduling, **kw)
    assert llm.config.async_scheduling is async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.engine.engine_core
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.config.cache.num_blocks
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "chunked", "preempting", "mixed_params"])
def test_async_matches_sync(tiny, device, case):
    prompts = _prompts(12, COMMON["vocab_size"], seed=3)
    kw: dict = {"num_blocks": 64}
    # different lengths, so requests finish (and leave the batch) at different steps
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]
    # every third request stops on the token it would sample third: a stop the async
    # path learns a step late, with the next step already launched
    first = run(tiny, device, False, prompts, params, num_blocks=64)
    for i in range(0, len(prompts), 3):
        params[i] = SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True,
                                   stop_token_ids=[first[i][0][2]])
    if case == "chunked":
        kw["max_num_batched_tokens"] = 7
    elif case == "preempting":
        kw["num_blocks"] = 12  # forces preemption while steps are in flight
    elif case == "mixed_params":
        # penalties and seeds read the tokens so far: those steps run one at a time
        params[1] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                   repetition_penalty=1.3)
        params[2] = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
        params[4] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                   min_tokens=10, stop_token_ids=[3])
    sync = run(tiny, device, False, prompts, params, **kw)
    ahead = run(tiny, device, True, prompts, params, **kw)
    assert ahead == sync
    stopped = [i for i, (_, reason) in enumerate(sync) if reason == "stop"]
    assert set(range(0, len(prompts), 3)) - {4} <= set(stopped)


def test_default_is_on_for_cuda_only(tiny):
    from vllmpy.config import EngineArgs
    from vllmpy.engine.configure import build_engine_config

    cfg = build_engine_config(EngineArgs(model=tiny, device="cpu"))
    assert cfg.async_scheduling is False
    cfg = build_engine_config(EngineArgs(model=tiny, device="cpu", async_scheduling=True))
    assert cfg.async_scheduling is True
