"""KV pool sizing, the serving length and the KV storage dtype."""

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
# values in one block of 32 tokens: 2 (k, v) x 2 layers x 32 x 2 heads x 16 dims
BLOCK_VALUES = 2 * 2 * 32 * 2 * 16
BLOCK_BYTES = BLOCK_VALUES * 4  # float32, the model dtype


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
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"vllmpy: KV cache: 256 blocks x 32 tokens = 8192 tokens, "
                        f"{256 * BLOCK_BYTES} bytes (float32, 4-byte values); max_model_len "
                        f"4096 (auto-fitted to the model's max_position_embeddings; "
                        f"--max-model-len sets it)")
    assert lines[1] == (f"vllmpy: KV cache: 16 blocks x 32 tokens = 512 tokens, "
                        f"{16 * BLOCK_BYTES} bytes (float32, 4-byte values); max_model_len 512 "
                        f"(auto-fitted to the KV pool; --max-model-len sets it)")
    build(model_dir, num_blocks=16, max_model_len=100)
    assert capsys.readouterr().err.rstrip().endswith("max_model_len 100 (--max-model-len)")


def test_kv_cache_memory_is_a_budget_for_the_whole_pool(model_dir, capsys):
    cfg = build(model_dir, kv_cache_memory=10 * BLOCK_BYTES + 5)
    assert cfg.cache.bytes_per_block == BLOCK_BYTES
    assert cfg.cache.num_blocks == 10
    assert (f"10 blocks x 32 tokens = 320 tokens, {10 * BLOCK_BYTES} bytes (float32, "
            f"4-byte values, sized by --kv-cache-memory {10 * BLOCK_BYTES + 5})"
            in capsys.readouterr().err)
    with pytest.raises(ConfigError, match="holds no KV block"):
        build(model_dir, kv_cache_memory=BLOCK_BYTES - 1)
    with pytest.raises(ConfigError, match="give one"):
        build(model_dir, kv_cache_memory=10**6, num_blocks=4)
    assert parse_byte_size("2GiB") == 2 * 2**30 and parse_byte_size("512M") == 512 * 10**6


def test_max_model_len_the_pool_cannot_hold_is_refused(model_dir):
    with pytest.raises(ConfigError) as e:
        build(model_dir, num_blocks=8, max_model_len=1000)
    msg = str(e.value)
    assert f"--max-model-len 1000 needs 32 KV blocks of 32 tokens ({32 * BLOCK_BYTES} bytes " \
        "at float32" in msg
    assert f"the pool has 8 blocks (256 tokens, {8 * BLOCK_BYTES} bytes)" in msg
    assert "raise --num-blocks to 32" in msg
    assert f"--kv-cache-memory to {32 * BLOCK_BYTES}" in msg
    assert msg.endswith("or lower --max-model-len to 256")
    assert "--kv-cache-dtype" not in msg  # the pool is sized in blocks: fp8 would not help
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        build(model_dir, max_model_len=5000)
    assert build(model_dir, num_blocks=8, max_model_len=256).model.max_model_len == 256


F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("kv, dtype, elem", [
    ("auto", torch.float32, 4), ("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2),
    ("fp8", F8, 1), ("fp8_e4m3", F8, 1)])
def test_kv_cache_dtype_sets_the_storage_and_the_bytes_per_block(model_dir, kv, dtype, elem):
    cache = build(model_dir, kv_cache_dtype=kv).cache
    assert cache.kv_cache_dtype == dtype
    assert cache.kv_cache_dtype_requested == kv
    assert cache.bytes_per_block == BLOCK_VALUES * elem


def test_fp8_holds_twice_the_tokens_of_bfloat16_in_the_same_memory(model_dir, capsys):
    memory = 12 * BLOCK_VALUES * 2  # twelve bfloat16 blocks
    bf16 = build(model_dir, kv_cache_dtype="bfloat16", kv_cache_memory=memory).cache
    fp8 = build(model_dir, kv_cache_dtype="fp8", kv_cache_memory=memory).cache
    assert bf16.num_tokens == 12 * 32
    assert fp8.num_tokens == 2 * bf16.num_tokens
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(
        f"vllmpy: KV cache: 12 blocks x 32 tokens = 384 tokens, {memory} bytes (bfloat16, "
        f"2-byte values, sized by --kv-cache-memory {memory}); max_model_len 384 ")
    assert lines[1].startswith(
        f"vllmpy: KV cache: 24 blocks x 32 tokens = 768 tokens, {memory} bytes (fp8_e4m3, "
        f"1-byte values, sized by --kv-cache-memory {memory}); max_model_len 768 ")


def test_a_refused_max_model_len_names_fp8_when_it_closes_the_gap(model_dir):
    memory = 8 * BLOCK_VALUES * 2  # 8 bfloat16 blocks, 16 fp8 blocks
    with pytest.raises(ConfigError) as e:
        build(model_dir, kv_cache_dtype="bfloat16", kv_cache_memory=memory, max_model_len=400)
    msg = str(e.value)
    assert f"needs 13 KV blocks of 32 tokens ({13 * BLOCK_VALUES * 2} bytes at bfloat16" in msg
    assert f"the pool has 8 blocks (256 tokens, {memory} bytes)" in msg
    assert ("use --kv-cache-dtype fp8 (1-byte pages: the same --kv-cache-memory holds 512 "
            "tokens)") in msg
    assert build(model_dir, kv_cache_dtype="fp8", kv_cache_memory=memory,
                 max_model_len=400).model.max_model_len == 400
    with pytest.raises(ConfigError) as e:  # 19 blocks: fp8's 16 would not be enough either
        build(model_dir, kv_cache_dtype="bfloat16", kv_cache_memory=memory, max_model_len=600)
    assert "--kv-cache-dtype" not in str(e.value)


@pytest.mark.parametrize("kv", ["float16", "fp8_e5m2", "int8"])
def test_unsupported_kv_cache_dtypes_are_refused_by_name(model_dir, kv):
    with pytest.raises(ConfigError, match=f"--kv-cache-dtype '?{kv}'?[ ;]"):
        build(model_dir, kv_cache_dtype=kv)


def test_float16_and_fp8_e5m2_parse_on_the_command_line():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for kv in ("float16", "fp8_e5m2", "fp8", "fp8_e4m3"):
        args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", kv]))
        assert args.kv_cache_dtype == kv
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])


def write_model(path, config_extra=None, hf_quant=None) -> str:
    (path / "config.json").write_text(json.dumps({**CONFIG, **(config_extra or {})}))
    if hf_quant is not None:
        text = hf_quant if isinstance(hf_quant, str) else json.dumps(hf_quant)
        (path / "hf_quant_config.json").write_text(text)
    return str(path)


def test_auto_takes_the_kv_dtype_config_json_declares(tmp_path, capsys):
    d = write_model(tmp_path, {"quantization_config": {"quant_method": "modelopt",
                                                       "kv_cache_quant_algo": "FP8"}})
    cache = build(d).cache
    assert cache.kv_cache_dtype == F8 and cache.bytes_per_block == BLOCK_VALUES
    err = capsys.readouterr().err
    assert ("KV cache dtype: fp8_e4m3 (1-byte pages, per-layer k_scale/v_scale), as the "
            "checkpoint's config.json quantization_config.kv_cache_quant_algo 'FP8' "
            "declares") in err


def test_auto_takes_the_kv_dtype_hf_quant_config_json_declares(tmp_path, capsys):
    d = write_model(tmp_path, hf_quant={"producer": {"name": "modelopt"},
                                        "quantization": {"quant_algo": None,
                                                         "kv_cache_quant_algo": "FP8"}})
    assert build(d).cache.kv_cache_dtype == F8
    assert "hf_quant_config.json quantization.kv_cache_quant_algo 'FP8'" in \
        capsys.readouterr().err


def test_config_json_is_read_before_hf_quant_config_json(tmp_path):
    d = write_model(tmp_path, {"quantization_config": {"kv_cache_quant_algo": "fp8"}},
                    hf_quant={"quantization": {"kv_cache_quant_algo": "NVFP4"}})
    assert build(d).cache.kv_cache_dtype == F8


def test_an_explicit_kv_cache_dtype_wins_over_the_declaration(tmp_path, capsys):
    d = write_model(tmp_path, hf_quant={"quantization": {"kv_cache_quant_algo": "FP8"}})
    assert build(d, kv_cache_dtype="bfloat16").cache.kv_cache_dtype == torch.bfloat16
    assert ("--kv-cache-dtype bfloat16 overrides the checkpoint's hf_quant_config.json "
            "quantization.kv_cache_quant_algo 'FP8'") in capsys.readouterr().err


def test_a_null_declaration_means_the_model_dtype(tmp_path, capsys):
    d = write_model(tmp_path, {"quantization_config": {"kv_cache_quant_algo": None}},
                    hf_quant={"quantization": {"kv_cache_quant_algo": None}})
    assert build(d).cache.kv_cache_dtype == torch.float32
    assert "KV cache dtype" not in capsys.readouterr().err


def test_an_unknown_declared_algorithm_is_refused_unless_a_flag_overrides_it(tmp_path):
    d = write_model(tmp_path, {"quantization_config": {"kv_cache_quant_algo": "NVFP4"}})
    with pytest.raises(ConfigError, match="kv_cache_quant_algo is 'NVFP4'") as e:
        build(d)
    assert "--kv-cache-dtype bfloat16" in str(e.value)
    assert build(d, kv_cache_dtype="bfloat16").cache.kv_cache_dtype == torch.bfloat16


def test_a_broken_hf_quant_config_json_is_refused_naming_it_unless_a_flag_decides(tmp_path):
    d = write_model(tmp_path, hf_quant="{not json")
    with pytest.raises(ConfigError, match="hf_quant_config.json could not be read as JSON"):
        build(d)
    assert build(d, kv_cache_dtype="fp8").cache.kv_cache_dtype == F8  # the flag decides


def test_fp8_on_cuda_needs_compute_capability_8_9(monkeypatch):
    from vllmpy.engine import configure

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigError, match=r"compute capability 8\.9 .*this one is 8\.0"):
        configure._check_kv_dtype_on_device(F8, "cuda")
    configure._check_kv_dtype_on_device(torch.bfloat16, "cuda")
    configure._check_kv_dtype_on_device(F8, "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    configure._check_kv_dtype_on_device(F8, "cuda")

def test_unknown_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["BloomForCausalLM"]}))
    from vllmpy import LLM

    with pytest.raises(ValueError, match="BloomForCausalLM"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")


def test_architecture_is_named_before_any_field(tmp_path):
    # a GPT-2 config has none of the Llama-style keys: its own converter reads it, and an
    # unknown architecture with such a config is named, not "no 'num_attention_heads'"
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["BloomForCausalLM"], "n_embd": 64, "n_layer": 2}))
    from vllmpy import LLM

    with pytest.raises(ValueError, match=r"architecture \['BloomForCausalLM'\] is not "
                                         r"supported"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")


def test_dummy_model_runs_on_token_ids(model_dir):
    from vllmpy import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", device="cpu", num_blocks=16)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer", SamplingParams(max_tokens=1))


def test_sliding_windows_are_per_layer_and_do_not_limit_the_serving_length(tmp_path):
    # the attention backends implement the window: the model is served at its full length
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "sliding_window": 256}))
    config = build(str(tmp_path), num_blocks=16)
    assert config.model.max_model_len == 512
    assert config.model.text_config.layer_windows == (256,) * CONFIG["num_hidden_layers"]
    # Qwen2-style: a window that use_sliding_window=false switches off
    (tmp_path / "config.json").write_text(json.dumps(
        {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 256,
         "use_sliding_window": False}))
    text = build(str(tmp_path), num_blocks=16).model.text_config
    assert text.layer_windows == (None,) * CONFIG["num_hidden_layers"]
