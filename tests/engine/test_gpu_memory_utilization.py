"""--gpu-memory-utilization: on CUDA with no flag sizing the pool, the pool gets what the
memory profile leaves; the arithmetic and its refusal are checked here on the CPU, the
profile itself on a GPU."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from vllmpy.config import ConfigError, EngineArgs
from vllmpy.engine.configure import _resolve_num_blocks, build_engine_config, finish_profiled_pool

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
BLOCK_BYTES = 2 * 2 * 32 * 2 * 16 * 4  # k+v, 2 layers, 32 tokens, 2 heads, 16 dims, fp32


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


def test_cuda_without_sizing_flags_defers_to_the_profile() -> None:
    args = EngineArgs()
    assert _resolve_num_blocks(args, BLOCK_BYTES, "cuda") == 0
    assert _resolve_num_blocks(args, BLOCK_BYTES, "cpu") == 256
    assert _resolve_num_blocks(EngineArgs(num_blocks=7), BLOCK_BYTES, "cuda") == 7
    assert _resolve_num_blocks(EngineArgs(kv_cache_memory=3 * BLOCK_BYTES), BLOCK_BYTES,
                               "cuda") == 3
    with pytest.raises(ConfigError, match="--gpu-memory-utilization must be in"):
        _resolve_num_blocks(EngineArgs(gpu_memory_utilization=1.5), BLOCK_BYTES, "cuda")


def test_profiled_pool_size_and_refusal(model_dir, capsys) -> None:
    cfg = build_engine_config(EngineArgs(model=model_dir, load_format="dummy", device="cpu",
                                         max_model_len=1000))
    sized = finish_profiled_pool(cfg, 40 * BLOCK_BYTES + 17, "the breakdown")
    assert sized.cache.num_blocks == 40
    assert sized.model.max_model_len == 1000
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"vllmpy: KV cache: 40 blocks x 32 tokens = 1280 tokens, "
                    f"{40 * BLOCK_BYTES} bytes (float32, 4-byte values, sized by "
                    f"--gpu-memory-utilization 0.9: the breakdown); max_model_len 1000 "
                    f"(--max-model-len)")
    # 1000 tokens need 32 blocks: 31 blocks' worth of bytes is refused with the fixes
    with pytest.raises(ConfigError) as err:
        finish_profiled_pool(cfg, 31 * BLOCK_BYTES, "the breakdown")
    message = str(err.value)
    assert "31 blocks of 32 tokens, fewer than the 32 one sequence" in message
    for fix in ("raise --gpu-memory-utilization", "lower --max-model-len",
                "--kv-cache-dtype fp8", "--num-blocks / --kv-cache-memory"):
        assert fix in message
    with pytest.raises(ConfigError, match="leaves 0 bytes"):
        finish_profiled_pool(cfg, -5, "the breakdown")


def test_flag_parses_a_fraction() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5
    assert parser.parse_args([]).gpu_memory_utilization == 0.9
    for bad in ("0", "1.2", "half"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--gpu-memory-utilization", bad])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_is_sized_from_free_memory(model_dir, capsys) -> None:
    from vllmpy import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", device="cuda", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5)
    err = capsys.readouterr().err
    assert "sized by --gpu-memory-utilization 0.5" in err
    free, total = torch.cuda.mem_get_info()
    pool = llm.config.cache.num_blocks * BLOCK_BYTES
    assert llm.config.cache.num_blocks > 0 and pool <= 0.5 * total
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
