"""vllm-bench: offline mode on a dummy-weight model and on SmolLM2, serving mode against a
real vllm-server, the report header and the JSON results, and refusals."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from server_utils import COMMON, start_server

from vllmpy.entrypoints import bench
from vllmpy.loader.pypi_weights import fetch

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}
RESULT_LINES = ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                "Output token throughput (tok/s):", "Total token throughput (tok/s):")


@pytest.fixture
def dummy_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path)


@pytest.fixture(scope="module")
def smollm_path() -> str:
    return str(fetch("smollm2", quiet=True))


def run_bench(capsys, *args: str) -> tuple[int, str, str]:
    rc = bench.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def report_values(out: str) -> dict[str, str]:
    """Report lines as label -> value; every value starts in the same column."""
    values = {}
    for line in out.splitlines():
        if ":" in line and not line.startswith(("=", "-")):
            assert line[42] == " " and line[43] != " ", line
            values[line[:42].rstrip()] = line[43:]
    return values


def test_offline_fixed_lengths(dummy_model, tmp_path, capsys):
    path = tmp_path / "out.json"
    rc, out, _ = run_bench(capsys, "--model", dummy_model, "--load-format", "dummy",
                           "--device", "cpu", "--num-prompts", "4", "--input-len", "8",
                           "--output-len", "5", "--num-blocks", "8", "--output-json", str(path))
    assert rc == 0
    assert "KV cache dtype (requested):                auto\n" in out
    assert "KV cache dtype (resolved storage):         float32 (4-byte pages)\n" in out
    values = report_values(out)
    assert values["Mode:"] == "offline pretokenized" and values["Block count:"] == "8"
    assert values["Device:"] == "cpu" and values["Block size:"] == "32"
    data = json.loads(path.read_text())
    for label in RESULT_LINES:
        if label == "Benchmark duration (s):":
            # printed to 0.01 s, which this tiny model can finish under
            assert data["duration"] > 0
            assert float(values[label]) == pytest.approx(data["duration"], abs=0.005)
        else:
            assert float(values[label]) > 0, label
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        for stat in ("Mean", "Median", "P90", "P99"):
            assert float(values[f"{stat} {metric} (ms):"]) > 0
    assert data["completed"] == 4 and data["failed"] == 0
    assert data["output_lens"] == [5] * 4 and data["input_lens"] == [8] * 4
    assert data["total_output_tokens"] == 20 == int(values["Total generated tokens:"])
    assert data["config"]["num_blocks"] == 8 and data["config"]["kv_cache_dtype"] == "float32"
    assert all(len(itl) == 4 for itl in data["itls"])
    assert data["output_throughput"] == pytest.approx(20 / data["duration"])


def test_offline_ranged_lengths_with_concurrency(dummy_model, tmp_path, capsys):
    path = tmp_path / "out.json"
    rc, out, err = run_bench(capsys, "--model", dummy_model, "--load-format", "dummy",
                             "--device", "cpu", "--dtype", "bfloat16", "--num-prompts", "6",
                             "--input-len", "4:12", "--output-len", "2:6", "--concurrency", "2",
                             "--seed", "3", "--warmup", "0", "--output-json", str(path))
    assert rc == 0, err
    assert "KV cache dtype (resolved storage):         bfloat16 (2-byte pages)\n" in out
    rng = np.random.default_rng(3)
    in_lens = bench.LengthRange(4, 12).sample(rng, 6)
    out_lens = bench.LengthRange(2, 6).sample(rng, 6)
    data = json.loads(path.read_text())
    assert data["input_lens"] == in_lens and data["output_lens"] == out_lens
    assert data["total_output_tokens"] == sum(out_lens)
    assert "concurrency 2" in err


def test_dataset_text_prompts_timed_as_strings(smollm_path, tmp_path, capsys, monkeypatch):
    dataset = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "The capital of France is", "output_len": 4},
             {"prompt": "Écris un poème sur la mer 🌊"},
             {"prompt_token_ids": [1, 2, 3, 4, 5], "output_len": 2}]
    dataset.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    monkeypatch.setenv("VT_BENCH_PRETOKENIZE", "0")
    path = tmp_path / "out.json"
    rc, out, err = run_bench(capsys, "--model", smollm_path, "--device", "cpu",
                             "--dataset-path", str(dataset), "--output-len", "3",
                             "--num-blocks", "16", "--warmup", "0", "--output-json", str(path))
    assert rc == 0, err
    assert report_values(out)["Mode:"] == "offline timed-strings"
    data = json.loads(path.read_text())
    assert data["completed"] == 3 and data["output_lens"] == [4, 3, 2]
    assert data["input_lens"][2] == 5


@pytest.mark.parametrize("args, needle", [
    (["--input-len", "5:3"], "--input-len"),
    (["--output-len", "x"], "--output-len"),
    (["--dataset-path", "/no/such/file.jsonl"], "--dataset-path"),
    (["--request-rate", "5"], "--request-rate"),
    (["--concurrency", "0"], "--concurrency"),
    (["--bogus"], "--bogus"),
])
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-bench: ") and needle in err[0]


def test_bad_dataset_line_exits_2_before_the_engine_starts(tmp_path, capsys):
    dataset = tmp_path / "bad.jsonl"
    dataset.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    rc, out, err = run_bench(capsys, "--model", "/no/model", "--dataset-path", str(dataset))
    assert rc == 2 and out == ""
    assert err.strip() == ("vllm-bench: --dataset-path line 2 has neither a 'prompt' string "
                           "nor 'prompt_token_ids'")


def test_serving_mode_against_a_real_server(smollm_path, capsys):
    server = start_server("--model", smollm_path, *COMMON, "--num-blocks", "64")
    try:
        rc, out, err = run_bench(capsys, "--base-url", server.url, "--model", smollm_path,
                                 "--num-prompts", "8", "--input-len", "16", "--output-len", "16",
                                 "--concurrency", "4")
        assert rc == 0, err
        values = report_values(out)
        assert values["Mode:"] == "serving"
        assert values["Successful requests:"] == "8" and values["Failed requests:"] == "0"
        assert values["Total generated tokens:"] == "128"
        assert values["Block count:"] == "64" and values["Max num seqs:"] == "64"
        assert values["Dtype:"] == "float32"
        assert "KV cache dtype (requested):                auto\n" in out
        assert "KV cache dtype (resolved storage):         float32 (4-byte pages)\n" in out
        for metric in ("TTFT", "TPOT", "ITL", "E2E"):
            for stat in ("Mean", "Median", "P90", "P99"):
                assert float(values[f"{stat} {metric} (ms):"]) > 0
        # a request the server refuses is counted and reported, not raised
        rc, out, err = run_bench(capsys, "--base-url", server.url, "--model", smollm_path,
                                 "--num-prompts", "1", "--input-len", "3000",
                                 "--output-len", "1")
        assert rc == 1
        assert report_values(out)["Failed requests:"] == "1"
        assert re.search(r"failed request: HTTP 400", err)
    finally:
        server.stop()


def test_warmup_prompts_are_fresh_so_a_prefix_cache_gains_nothing():
    args = bench.parse_args(["--model", "m", "--num-prompts", "4", "--input-len", "20",
                             "--output-len", "3", "--warmup", "3"])
    timed = bench.build_requests(args, 500, {0}, tokenizer=None, as_text=False)
    warm = bench.warmup_requests(args, timed, 500, {0}, tokenizer=None, as_text=False)
    assert len(warm) == 3
    assert all(len(w.prompt) == 20 and w.output_len == 3 for w in warm)
    assert not {tuple(w.prompt) for w in warm} & {tuple(t.prompt) for t in timed}
    assert all(0 not in w.prompt for w in warm)  # forbidden ids stay out
