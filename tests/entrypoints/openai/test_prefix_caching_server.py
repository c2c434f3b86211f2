"""Prefix caching and scheduling policies through vllm-server: cached_tokens in usage,
the prefix-cache metrics, POST /reset_prefix_cache, cache_salt and priority."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_utils import COMMON, start_server

pytestmark = pytest.mark.slow

BLOCK = 32  # the default --block-size of the session server
LONG = ("Prefix caching keeps the attention keys and values of a prompt after the request "
        "ends, so that the next request starting with the same words skips recomputing "
        "them. A long system prompt shared by every conversation is where it pays most: "
        "each new chat only computes its own turn. The cache is organised in blocks of "
        "tokens, and a block is reused only when every token before it matches too.")


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{")]
    assert values, f"{name} not in /metrics"
    return sum(values)


def cached(usage) -> int:
    details = usage.prompt_tokens_details
    return 0 if details is None else (details.cached_tokens or 0)


def complete(server, prompt=LONG, **extra):
    return server.client().completions.create(
        model=None, prompt=prompt, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, **extra})


def reset(server) -> dict:
    return httpx.post(f"{server.url}/reset_prefix_cache").json()


def test_a_repeated_prompt_hits_the_cache_until_it_is_reset(server):
    assert reset(server) == {"success": True}
    queries0 = metric(server, "vllm:prefix_cache_queries_total")
    hits0 = metric(server, "vllm:prefix_cache_hits_total")

    cold = complete(server)
    n = cold.usage.prompt_tokens
    assert n > 2 * BLOCK and cached(cold.usage) == 0
    warm = complete(server)
    expected = (n - 1) // BLOCK * BLOCK  # whole blocks, never the last prompt token
    assert cached(warm.usage) == expected > 0
    assert warm.choices[0].text == cold.choices[0].text
    assert metric(server, "vllm:prefix_cache_queries_total") == queries0 + 2 * n
    assert metric(server, "vllm:prefix_cache_hits_total") == hits0 + expected

    assert reset(server) == {"success": True}
    after = complete(server)
    assert cached(after.usage) == 0
    assert after.choices[0].text == cold.choices[0].text
    assert metric(server, "vllm:prefix_cache_hits_total") == hits0 + expected


def test_chat_and_streamed_usage_carry_cached_tokens(server):
    client = server.client()
    messages = [{"role": "system", "content": LONG},
                {"role": "user", "content": "Summarise that in one line."}]
    first = client.chat.completions.create(model=None, messages=messages, max_tokens=4,
                                           temperature=0)
    second = client.chat.completions.create(model=None, messages=messages, max_tokens=4,
                                            temperature=0)
    n = second.usage.prompt_tokens
    assert cached(second.usage) == (n - 1) // BLOCK * BLOCK > 0
    assert second.choices[0].message.content == first.choices[0].message.content

    stream = client.chat.completions.create(model=None, messages=messages, max_tokens=4,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and cached(usage[0]) == cached(second.usage)

    complete(server)  # LONG is cached
    stream = client.completions.create(model=None, prompt=[LONG, LONG], max_tokens=3,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    n = usage[0].prompt_tokens // 2
    assert cached(usage[0]) == 2 * ((n - 1) // BLOCK * BLOCK)  # summed over both prompts


def test_cache_salt_shares_only_within_a_salt(server):
    complete(server)  # LONG is cached unsalted
    first = complete(server, cache_salt="tenant-a")
    assert cached(first.usage) == 0
    again = complete(server, cache_salt="tenant-a")
    assert cached(again.usage) > 0
    assert cached(complete(server, cache_salt="tenant-b").usage) == 0
    assert again.choices[0].text == first.choices[0].text
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": LONG, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_priority_needs_the_priority_policy(server):
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, priority=2)
    err = e.value.body
    assert err["param"] == "priority" and err["code"] == 400
    assert "Got priority 2 but Priority scheduling is not enabled" in err["message"]
    assert "--scheduling-policy fcfs" in err["message"]
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"priority": -1})
    assert complete(server, priority=0).choices[0].finish_reason == "length"


CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}


def test_priority_server_and_flags_in_server_info(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    s = start_server("--model", str(tmp_path), "--load-format", "dummy", *COMMON,
                     "--num-blocks", "32", "--max-model-len", "256",
                     "--scheduling-policy", "priority", "--disable-radix-attention")
    try:
        info = httpx.get(f"{s.url}/server_info").json()["vllm_config"]
        assert (info["scheduling_policy"], info["enable_prefix_caching"]) == ("priority", False)
        bodies = [{"prompt": list(range(1, 40)), "max_tokens": 4, "temperature": 0,
                   "ignore_eos": True, "priority": p} for p in (0, 5, -5)]
        outs = [httpx.post(f"{s.url}/v1/completions", json=b, timeout=120).json()
                 for b in bodies]
        assert all(t["choices"][0]["finish_reason"] == "length" for t in outs)
        assert all(t["usage"].get("prompt_tokens_details") is None for t in outs)
        # with prefix caching off there is nothing to reset
        assert httpx.post(f"{s.url}/reset_prefix_cache").json() == {"success": False}
    finally:
        s.stop()
