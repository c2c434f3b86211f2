"""vllm-server end to end, through the openai SDK over a real socket."""

from __future__ import annotations

import json
import re
import threading

import httpx
import openai
import pytest
from server_utils import COMMON, start_server

from vllmpy import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def metric(server, name: str) -> float:
    """Sum of one metric's samples (all label sets) from /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} not in /metrics"
    return total


@pytest.fixture(scope="module")
def llm(smollm_path):
    return LLM(smollm_path, device="cpu", dtype="float32", num_blocks=128, max_model_len=2048)


def test_completion_forms(server, llm):
    c = server.client()
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                            use_tqdm=False)[0]
    r = c.completions.create(model=None, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model.startswith("SmolLM2")
    assert r.choices[0].text == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    batch = c.completions.create(model=r.model, prompt=[PROMPT, "def f():"], max_tokens=5,
                                 temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.choices[0].text == llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text
    ids = expected.prompt_token_ids
    by_ids = c.completions.create(model=r.model, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected.outputs[0].text
    two = c.completions.create(model=r.model, prompt=[ids, ids], max_tokens=3, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].text == two.choices[1].text
    echo = c.completions.create(model=r.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                echo=True)
    assert echo.choices[0].text.startswith(PROMPT)
    n2 = c.completions.create(model=r.model, prompt=PROMPT, max_tokens=6, n=2,
                              temperature=1.0, seed=3)
    assert [ch.index for ch in n2.choices] == [0, 1]


def test_stream_equals_non_stream(server):
    c = server.client()
    full = c.completions.create(model=None, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(c.completions.create(model=None, prompt=PROMPT, max_tokens=20, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices
                and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    with_usage = list(c.completions.create(
        model=None, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    continuous = list(c.completions.create(
        model=None, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in continuous]
    assert all(ch.usage is not None for ch in continuous)
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat = c.chat.completions.create(model=None, messages=msgs, max_tokens=24, temperature=0)
    stream = list(c.chat.completions.create(model=None, messages=msgs, max_tokens=24,
                                            temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == chat.choices[0].message.content
    assert sum(1 for ch in stream if ch.choices and ch.choices[0].finish_reason) == 1


@pytest.mark.parametrize("which", ["server", "qwen_server"])
def test_chat_equals_library_chat(request, which, smollm_path, qwen_path):
    srv = request.getfixturevalue(which)
    path = smollm_path if which == "server" else qwen_path
    lib = LLM(path, device="cpu", dtype="float32", num_blocks=32, max_model_len=1024)
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name two colors."}]}]
    expected = lib.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    r = srv.client().chat.completions.create(model=None, messages=msgs, max_tokens=16,
                                             temperature=0)
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_models_health_version_tokenize(server, llm):
    c = server.client()
    models = c.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert "version" in httpx.get(f"{server.url}/version").json()
    tok = llm.get_tokenizer()
    for text in [PROMPT, "héllo 🎉 wörld\n\tcode()", "12345"]:
        r = httpx.post(f"{server.url}/tokenize", json={"prompt": text,
                                                       "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
        assert back["prompt"] == text
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == llm.render_chat(msgs)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token_id"] == tok.eos_token_id
    assert httpx.get(f"{server.url}/server_info").json()["vllm_config"]["max_model_len"] == 2048
    assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"success": True}


def test_metrics_move(server):
    before_prompt = metric(server, "vllm:prompt_tokens_total")
    before_gen = metric(server, "vllm:generation_tokens_total")
    before_ok = metric(server, "vllm:request_success_total")
    server.client().completions.create(model=None, prompt=PROMPT, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert metric(server, "vllm:prompt_tokens_total") == before_prompt + 5
    assert metric(server, "vllm:generation_tokens_total") == before_gen + 7
    assert metric(server, "vllm:request_success_total") == before_ok + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:iteration_tokens_total"]:
        assert name in text, name


def test_concurrent_streams_and_disconnects(server):
    c = server.client()
    results: list[str] = []
    errors: list[BaseException] = []

    def stream_one(i: int) -> None:
        try:
            chunks = c.completions.create(model=None, prompt=f"Story number {i}:",
                                          max_tokens=16, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            results.append("".join(ch.choices[0].text for ch in chunks if ch.choices))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 20 and all(results)

    def disconnect_one(i: int) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "prompt": f"Tell me a long story {i}", "max_tokens": 400, "stream": True,
                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # leave after the first token

    threads = [threading.Thread(target=disconnect_one, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import time

    deadline = time.time() + 60
    while time.time() < deadline:
        if (metric(server, "vllm:num_requests_running") == 0
                and metric(server, "vllm:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.5)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0
    assert c.completions.create(model=None, prompt=PROMPT, max_tokens=2).choices[0].text


def _post(server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json"}, **kw)


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "x"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", b'{"prompt": "x",', 400, "JSON"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400,
     "stream"),
    ("/v1/completions", {"prompt": [[1] * 2048]}, 400, "2048"),
    ("/v1/completions", {"prompt": "x" * (2048 * 81 + 1)}, 400, "bytes"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "out of range"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"tools": []}}, 400, "tools"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/nope", {}, 404, "/v1/nope"),
])
def test_error_rules(server, path, body, status, needle):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and needle in err["message"], err
    assert set(err) >= {"message", "type", "param", "code"}


def test_prompt_at_max_model_len_names_both_lengths(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=None, prompt=[1] * 2100, max_tokens=1)
    assert "2100" in str(e.value) and "2048" in str(e.value)


def test_over_large_body_is_413(server):
    r = _post(server, "/v1/completions", b"{" + b" " * (33 * 2**20) + b"}")
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_server_flags(smollm_path, tmp_path):
    import json
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "vllmpy.entrypoints.openai.api_server",
                               *args], capture_output=True, text=True, timeout=120)

    r = run("--model", smollm_path, "--tensor-parallel-size", "2")
    assert r.returncode == 2
    assert r.stderr.strip() == "server: unknown argument '--tensor-parallel-size'"
    r = run("--model", smollm_path, "--port", "0")
    assert r.returncode == 2 and "--port" in r.stderr
    # refused by the config, which the engine core builds: the same one line and code
    r = run("--model", smollm_path, "--max-model-len", "100000000")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("server: --max-model-len 100000000")
    # an architecture no converter reads: named before any field, the same one line and code
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_embd": 64,
        "n_layer": 2, "vocab_size": 256}))
    r = run("--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(
        "server: architecture ['BloomForCausalLM'] is not supported")


def test_api_key_notices_and_keepalive(smollm_path):
    s = start_server("--model", smollm_path, *COMMON, "--num-blocks", "16", "--api-key",
                     "sekret", "--trust-remote-code", "--enable-auto-tool-choice",
                     "--allowed-origins", "http://example.com",
                     env={"VT_SERVER_SSE_PING_S": "0.001"})
    try:
        pre = httpx.options(f"{s.url}/v1/completions", headers={
            "origin": "http://example.com", "access-control-request-method": "POST"})
        assert pre.headers.get("access-control-allow-origin") == "http://example.com"
        other = httpx.options(f"{s.url}/v1/completions", headers={
            "origin": "http://evil.example", "access-control-request-method": "POST"})
        assert other.headers.get("access-control-allow-origin") is None
        notices = [ln for ln in s.stderr_lines if "published-recipe compatibility" in ln]
        assert len(notices) == 2
        assert any("listening on http://127.0.0.1" in ln for ln in s.stderr_lines)
        assert any(re.search(r"max_model_len 512", ln) for ln in s.stderr_lines)
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model=None, prompt=PROMPT, max_tokens=2)
        ok = s.client("sekret")
        full = ok.completions.create(model=None, prompt=PROMPT, max_tokens=16, temperature=0)
        with httpx.stream("POST", f"{s.url}/v1/completions", timeout=120,
                          headers={"authorization": "Bearer sekret"},
                          json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                "stream": True}) as r:
            lines = list(r.iter_lines())
        assert ":" in lines  # at least one keepalive comment frame
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines
                       if ln.startswith("data: {"))
        assert text == full.choices[0].text
        assert [ln for ln in lines if ln][-1] == "data: [DONE]"
    finally:
        s.stop()
