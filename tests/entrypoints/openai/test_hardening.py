"""Bad input that used to be a 500 or a hang is a 400 naming what was wrong; the surface
the spec names (404 for an unknown model, 405 with Allow, a documented /openapi.json,
ignored fields named, logs cut inside the line); the API key on every route but
/health, /ping and /metrics; CORS; bounds enforced before any work is queued."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import TINY_SERVER, start_server

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://good.example"


@pytest.fixture(scope="module")
def hard_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "64",
                     "--max-model-len", "512", "--api-key", KEY, "--allowed-origins", ORIGIN,
                     "--max-request-body-bytes", "65536", "--max-log-len", "20",
                     "--enable-log-outputs", env={"VT_SERVER_MAX_NEW_TOKENS": "8"})
    yield s
    s.stop()


def post(server, path: str, body, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **AUTH, **headers})


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"], error
    for needle in needles:
        assert needle in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("function", ["f", ["f"], 3, None])
def test_a_tool_choice_function_that_is_not_an_object_is_a_400(hard_server, function):
    r = post(hard_server, "/v1/chat/completions", {
        **CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": function}})
    assert_error(r, 400, "tool_choice must be", param="tool_choice")


LONE = '"a\\ud800b"'  # a JSON string holding an unpaired surrogate (written at @)


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", '{"prompt": @}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", @]}', "prompt.1"),
    ("/v1/completions", '{"prompt": "ok", "stop": [@]}', "stop.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": @}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
     '"text": @}]}]}', "messages.0.content.0.text"),
    ("/tokenize", '{"prompt": @}', "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_where(hard_server, path, body, where):
    r = post(hard_server, path, body.replace("@", LONE).encode())
    assert_error(r, 400, "lone UTF-16 surrogate", param=where)


def test_a_surrogate_pair_is_text(hard_server):
    r = post(hard_server, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["count"] >= 1


@pytest.mark.parametrize("max_tokens", [2**63, 2**64 + 5, 10**9, 600])
def test_max_tokens_past_the_context_is_a_400_naming_the_lengths(hard_server, max_tokens):
    for path, body in (("/v1/completions", {"prompt": "hello"}), ("/v1/chat/completions", CHAT)):
        r = post(hard_server, path, {**body, "max_tokens": max_tokens})
        assert_error(r, 400, "maximum context length is 512 tokens",
                     f"{max_tokens} in the completion", param="max_tokens")


def test_a_non_positive_max_tokens_still_means_unset(hard_server):
    r = post(hard_server, "/v1/completions", {"prompt": "hello", "max_tokens": -1,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8  # the serving cap, not the context


def test_an_unknown_model_is_a_404(hard_server):
    r = post(hard_server, "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    error = assert_error(r, 404, "`gpt-4` does not exist", param="model")
    assert error["type"] == "NotFoundError"


def test_a_wrong_method_is_a_405_with_allow(hard_server):
    r = httpx.put(f"{hard_server.url}/v1/completions", headers=AUTH)
    assert_error(r, 405, "PUT")
    assert r.headers["allow"] == "POST"


def test_openapi_documents_bodies_errors_and_one_id_per_operation(hard_server):
    doc = httpx.get(f"{hard_server.url}/openapi.json", headers=AUTH).json()
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"], path
        assert {"400", "401", "404", "413", "500", "503"} <= set(op["responses"]), path
        assert "422" not in op["responses"]
    schemas = doc["components"]["schemas"]
    assert {"prompt", "max_tokens", "n"} <= set(schemas["CompletionRequest"]["properties"])
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}


def test_ignored_fields_are_named_in_a_warning_and_the_request_served(hard_server):
    r = post(hard_server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                              "frobnicate": 1, "zz_extra": "y"})
    assert r.status_code == 200, r.text
    warnings = [ln for ln in hard_server.stderr_lines if "ignored" in ln]
    assert any("'frobnicate', 'zz_extra'" in ln for ln in warnings), warnings


def test_long_prompts_are_cut_inside_the_log_line(hard_server):
    prompt = "a very long prompt " * 20
    r = post(hard_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    line = next(ln for ln in reversed(hard_server.stderr_lines) if "completion prompts=" in ln)
    assert repr(prompt[:20]) + "... (cut to 20 characters)" in line
    assert "params=SamplingParams(" in line and line.rstrip().endswith(")")  # line whole


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
    ("GET", "/server_info"), ("POST", "/reset_prefix_cache"), ("GET", "/openapi.json")])
def test_the_api_key_guards_every_route_but_health_and_metrics(hard_server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{hard_server.url}{path}", headers=headers, timeout=30)
        assert_error(r, 401, "API key")
        assert r.json()["error"]["type"] == "AuthenticationError"


def test_health_ping_and_metrics_need_no_key(hard_server):
    for path in ("/health", "/ping", "/metrics"):
        assert httpx.get(f"{hard_server.url}{path}").status_code == 200, path


def test_cors_for_the_allowed_origin_only(hard_server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{hard_server.url}/v1/completions", headers=preflight)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(f"{hard_server.url}/v1/completions",
                        headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in bad.headers
    refused = httpx.get(f"{hard_server.url}/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401  # the refusal is readable by the allowed page
    assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_a_chunked_body_past_the_limit_is_a_413(hard_server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{hard_server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "65536 bytes")


@pytest.mark.parametrize("n, status", [(129, 400), (0, 400), (None, 200), (3, 200)])
def test_n_is_bounded_and_null_means_one(hard_server, n, status):
    r = post(hard_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": n})
    assert r.status_code == status, r.text
    if status == 200:
        assert len(r.json()["choices"]) == (n or 1)
    else:
        assert r.json()["error"]["param"] == "n"


def test_the_server_is_still_serving(hard_server):
    r = post(hard_server, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
