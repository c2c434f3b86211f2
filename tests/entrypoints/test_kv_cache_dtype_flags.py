"""--kv-cache-dtype through every entry point: vllm-bench's header, vllm-cli, vllm-server's
flags (the library's ``LLM`` is covered in tests/attention/test_fp8_kv_cache.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllmpy.entrypoints import bench
from vllmpy.loader.pypi_weights import fetch

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
BENCH = ("--load-format", "dummy", "--device", "cpu", "--num-prompts", "2", "--input-len", "8",
         "--output-len", "3", "--num-blocks", "8", "--warmup", "0")


def header(out: str) -> dict[str, str]:
    return {line[:42].rstrip(): line[43:] for line in out.splitlines()
            if line.startswith("KV cache dtype")}


def test_bench_reports_fp8_storage_as_one_byte_pages(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    result = tmp_path / "out.json"
    rc = bench.main(["--model", str(tmp_path), *BENCH, "--kv-cache-dtype", "fp8",
                     "--output-json", str(result)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert header(out) == {"KV cache dtype (requested):": "fp8",
                           "KV cache dtype (resolved storage):": "fp8_e4m3 (1-byte pages)"}
    assert json.loads(result.read_text())["config"]["kv_cache_dtype"] == "fp8_e4m3"


def test_bench_resolves_auto_to_the_fp8_the_checkpoint_declares(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    rc = bench.main(["--model", str(tmp_path), *BENCH])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert header(out) == {"KV cache dtype (requested):": "auto",
                           "KV cache dtype (resolved storage):": "fp8_e4m3 (1-byte pages)"}
    assert "hf_quant_config.json quantization.kv_cache_quant_algo 'FP8'" in err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))


def test_cli_serves_on_fp8_pages_and_refuses_float16_by_name():
    model = str(fetch("smollm2", quiet=True))
    proc = run_cli("--model", model, "--prompt", "The capital of France is",
                   "--max-tokens", "4", "--temperature", "0", "--num-blocks", "16",
                   "--kv-cache-dtype", "fp8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "(fp8_e4m3, 1-byte values)" in proc.stderr
    assert "every layer serves on scale 1.0" in proc.stderr
    proc = run_cli("--model", model, "--prompt", "hi", "--kv-cache-dtype", "float16")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "vllm-cli: --kv-cache-dtype float16 is not supported")


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "bfloat16", "float16", "fp8_e5m2"])
def test_server_takes_the_flag_into_its_engine_args(value):
    from vllmpy.config import EngineArgs
    from vllmpy.entrypoints.openai.cli_args import parse_server_args

    args = parse_server_args(["--model", "m", "--kv-cache-dtype", value])
    assert EngineArgs.from_cli_args(args).kv_cache_dtype == value
