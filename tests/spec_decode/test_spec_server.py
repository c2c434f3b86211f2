"""The server under --speculative-config: same completions as without it, vLLM's
spec_decode counters on /metrics, and vllm-bench's report of the acceptance length."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import TINY_LLAMA, TINY_SERVER, start_server

from vllmpy.entrypoints import bench


@pytest.fixture(scope="module")
def draft_dir(tiny_chat_model, tmp_path_factory):
    draft = tmp_path_factory.mktemp("draft")
    (draft / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_hidden_layers=1)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_chat_model}/{name}", draft)
    return str(draft)


@pytest.fixture(scope="module")
def servers(tiny_chat_model, draft_dir):
    common = ("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "128",
              "--max-model-len", "1024", "--disable-log-requests")
    spec = json.dumps({"model": draft_dir, "num_speculative_tokens": 3})
    plain = start_server(*common)
    with_spec = start_server(*common, "--speculative-config", spec)
    yield plain, with_spec
    plain.stop()
    with_spec.stop()


def counters(server) -> dict[tuple[str, str | None], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, s.labels.get("position")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:spec_decode")}


def complete(server, prompt: str) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
        "logprobs": 1})
    r.raise_for_status()
    return r.json()["choices"][0]


def test_completions_match_and_counters_move(servers):
    plain, with_spec = servers
    before = counters(with_spec)
    for prompt in ("Hello hello hello", "a b c a b c a b", "def f(x):"):
        a, b = complete(plain, prompt), complete(with_spec, prompt)
        assert b["text"] == a["text"]
        assert b["logprobs"]["tokens"] == a["logprobs"]["tokens"]
    after = counters(with_spec)

    def grown(name: str, position: str | None = None) -> float:
        return after[(name, position)] - before.get((name, position), 0.0)

    drafts = grown("vllm:spec_decode_num_drafts_total")
    drafted = grown("vllm:spec_decode_num_draft_tokens_total")
    accepted = grown("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and drafted == pytest.approx(3 * drafts, abs=3 * 3)
    assert 0 <= accepted <= drafted
    per_pos = [grown("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))
               for i in range(3)]
    assert sum(per_pos) == accepted
    assert not any(name.startswith("vllm:spec") for name, _ in counters(plain))
    summary = bench.spec_decode_summary(
        {}, bench.scrape_spec_counters(with_spec.url))
    assert summary is not None and summary["mean_acceptance_length"] >= 1.0
    assert bench.scrape_spec_counters(plain.url) is None


def test_server_info_names_the_speculative_config(servers, draft_dir):
    plain, with_spec = servers
    info = httpx.get(f"{with_spec.url}/server_info").json()["vllm_config"]
    spec = info["speculative_config"]
    assert (spec["method"], spec["model"], spec["num_speculative_tokens"]) == (
        "draft_model", draft_dir, 3)
    assert httpx.get(f"{plain.url}/server_info").json()["vllm_config"][
        "speculative_config"] is None
    assert any("speculative decoding: draft model" in line
               for line in with_spec.stderr_lines)
