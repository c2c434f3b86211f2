"""/metrics against what the clients received: token counters move while a request runs,
and their deltas equal the tokens handed out; aborted requests count as "abort"."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import TINY_SERVER, start_server

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def metrics_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "128",
                     "--max-model-len", "1024", "--disable-log-requests")
    yield s
    s.stop()


def scrape(server) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def delta(after, before, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


def test_generation_tokens_move_while_a_request_runs(metrics_server):
    before = scrape(metrics_server)
    with httpx.stream("POST", f"{metrics_server.url}/v1/completions", timeout=60, json={
            "prompt": "a long one", "max_tokens": 400, "stream": True, **GREEDY}) as r:
        received = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received >= 20:
                during = scrape(metrics_server)
                break
    assert during[("vllm:num_requests_running", ())] == 1
    assert delta(during, before, "vllm:generation_tokens_total") >= 20
    assert delta(during, before, "vllm:prompt_tokens_total") > 0
    assert delta(during, before, "vllm:request_success_total", finished_reason="length") == 0


def _stream_tokens(server, body: dict, stop_after: int | None = None) -> int:
    """Tokens a streaming completion handed out (one per chunk with text or a finish),
    counted from its logprobs; ``stop_after`` chunks: then drop the connection."""
    got = 0
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "logprobs": 0}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                got += len((choice.get("logprobs") or {}).get("tokens") or [])
            if stop_after is not None and got >= stop_after:
                return got
    return got


def test_counter_deltas_equal_the_tokens_the_clients_received(metrics_server):
    s = metrics_server
    before = scrape(s)
    prompt_tokens = completion_tokens = 0
    for i in range(4):
        usage = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
            "prompt": f"whole {i}", "max_tokens": 7 + i, **GREEDY}).json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    for i in range(2):
        usage = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 5,
            **GREEDY}).json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    streamed = sum(_stream_tokens(s, {"prompt": f"stream {i}", "max_tokens": 9, **GREEDY})
                   for i in range(3))
    assert streamed == 27
    stream_prompts = sum(len(httpx.post(f"{s.url}/tokenize", json={
        "prompt": f"stream {i}"}).json()["tokens"]) for i in range(3))
    after = scrape(s)
    assert delta(after, before, "vllm:generation_tokens_total") == completion_tokens + streamed
    assert delta(after, before, "vllm:prompt_tokens_total") == prompt_tokens + stream_prompts
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 9
    assert delta(after, before, "vllm:request_generation_tokens_sum") == \
        completion_tokens + streamed
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 9


def test_aborted_requests_count_as_abort_with_their_tokens(metrics_server):
    s = metrics_server
    before = scrape(s)
    received = [_stream_tokens(s, {"prompt": f"drop {i}", "max_tokens": 300, **GREEDY},
                               stop_after=5 + i) for i in range(4)]
    after = None
    for _ in range(100):  # the server notices each disconnect within a step or two
        after = scrape(s)  # (the running gauge is published with the step after the last)
        if (delta(after, before, "vllm:request_success_total", finished_reason="abort") == 4
                and after[("vllm:num_requests_running", ())] == 0):
            break
    assert after is not None
    assert delta(after, before, "vllm:request_success_total", finished_reason="abort") == 4
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 0
    counted = delta(after, before, "vllm:generation_tokens_total")
    # every token handed out is counted; the few computed after the disconnect are too
    assert sum(received) <= counted < 4 * 300
    assert delta(after, before, "vllm:request_generation_tokens_sum") == counted
    assert after[("vllm:num_requests_running", ())] == 0
