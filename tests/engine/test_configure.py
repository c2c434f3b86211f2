"""KV pool sizing and the serving length."""

from __future__ import annotations

import json

import pytest
import torch

from vllmpy.config import ConfigError, EngineArgs, parse_byte_size
from vllmpy.engine.configure import build_engine_config

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
# one block of 32 tokens: 2 (k, v) x 2 layers x 32 x 2 heads x 16 dims x 4 bytes
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 4


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def build(model_dir, **kw):
    return build_engine_config(EngineArgs(model=model_dir, load_format="dummy", device="cpu",
                                          **kw))


def test_defaults_fit_the_serving_length_to_the_pool(model_dir, capsys):
    cfg = build(model_dir)
    assert cfg.cache.num_blocks == 256 and cfg.cache.block_size == 32
    assert cfg.model.max_model_len == 4096  # max_position_embeddings < 8192 pool tokens
    cfg = build(model_dir, num_blocks=16)
    assert cfg.model.max_model_len == 512
    err = capsys.readouterr().err
    assert "max_model_len not set: fitted to the KV pool (16 blocks x 32 tokens): 512" in err


def test_kv_cache_memory_is_a_budget_for_the_whole_pool(model_dir, capsys):
    cfg = build(model_dir, kv_cache_memory=10 * BLOCK_BYTES + 5)
    assert cfg.cache.bytes_per_block == BLOCK_BYTES
    assert cfg.cache.num_blocks == 10
    assert f"10 blocks x 32 tokens = 320 tokens, {10 * BLOCK_BYTES} bytes" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match="holds no KV block"):
        build(model_dir, kv_cache_memory=BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="give one"):
        build(model_dir, kv_cache_memory=10**6, num_blocks=4)
    assert parse_byte_size("2GiB") == 2 * 2**30 and parse_byte_size("512M") == 512 * 10**6


def test_max_model_len_the_pool_cannot_hold_is_refused(model_dir):
    with pytest.raises(ConfigError) as e:
        build(model_dir, num_blocks=8, max_model_len=1000)
    msg = str(e.value)
    assert "--max-model-len 1000 needs 32 KV blocks" in msg and "has 8 blocks" in msg
    assert "--num-blocks" in msg and "--kv-cache-memory" in msg
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build(model_dir, max_model_len=5000)
    assert build(model_dir, num_blocks=8, max_model_len=256).model.max_model_len == 256


@pytest.mark.parametrize("kv, ok", [("auto", torch.float32), ("bfloat16", torch.bfloat16),
                                    ("float16", None), ("fp8_e5m2", None), ("fp8", None)])
def test_kv_cache_dtype(model_dir, kv, ok):
    if ok is None:
        with pytest.raises(ConfigError, match=kv):
            build(model_dir, kv_cache_dtype=kv)
    else:
        assert build(model_dir, kv_cache_dtype=kv).cache.kv_cache_dtype == ok


def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    from vllmpy import LLM

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")


def test_dummy_model_runs_on_token_ids(model_dir):
    from vllmpy import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", device="cpu", num_blocks=16)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer", SamplingParams(max_tokens=1))


def test_sliding_window_models_are_limited_to_the_window(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "sliding_window": 256}))
    with pytest.raises(ConfigError, match="sliding window of 256 tokens"):
        build(str(tmp_path), num_blocks=16)
    assert build(str(tmp_path), num_blocks=16, max_model_len=256).model.max_model_len == 256
    # Qwen2-style: a window that use_sliding_window=false switches off
    (tmp_path / "config.json").write_text(json.dumps(
        {**CONFIG, "sliding_window": 256, "use_sliding_window": False}))
    assert build(str(tmp_path), num_blocks=16).model.max_model_len == 512
