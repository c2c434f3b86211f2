"""Load, each with its figures: streams aborted at every stage leave nothing behind, a soak
keeps both processes' memory flat, and concurrent greedy requests match the same
requests run one at a time.

Sizes fit CI; ``--soak-requests N`` and ``--abort-requests N`` run larger ones by hand.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from server_utils import TINY_SERVER, engine_core_pid, rss_bytes, start_server


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def _settled(client: httpx.AsyncClient, timeout: float = 20) -> dict[str, float]:
    """Wait until nothing runs, waits or holds KV blocks; returns those gauges."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        gauges = {name: _metric(text, name) for name in names}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def load_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--num-blocks", "256",
                     "--max-model-len", "2048", "--max-num-seqs", "16",
                     "--disable-log-requests")
    yield s
    s.stop()


GREEDY = {"temperature": 0, "ignore_eos": True}


async def _abort_one(client: httpx.AsyncClient, rng: random.Random, stage: str) -> str:
    """One streaming request, dropped at ``stage``; returns how far it got."""
    prompt = "tell me about it " * (200 if stage == "prefill" else rng.randint(1, 8))
    body = {"prompt": prompt, "max_tokens": 64, "stream": True, **GREEDY}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        if stage in ("before_first_token", "prefill", "queued"):
            return stage  # closed before reading a byte of the stream
        wanted, seen = rng.randint(1, 30), 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen >= wanted:
                    return "mid_stream"
        return "finished"


def test_aborted_streams_leave_no_trace(load_server, request, figures):
    count = request.config.getoption("--abort-requests")
    stages = ("before_first_token", "mid_stream", "prefill", "queued")

    async def run() -> tuple[dict[str, int], dict[str, float], str, str, bool]:
        async with httpx.AsyncClient(base_url=load_server.url, timeout=60) as client:
            probe = {"prompt": "The same prompt each time, for the cache", "max_tokens": 16,
                     **GREEDY}
            before = (await client.post("/v1/completions", json=probe)).json()
            rng = random.Random(0)
            outcomes: dict[str, int] = {}
            # waves of 48 against 16 seats: a third of each wave waits in the queue
            for start in range(0, count, 48):
                wave = [_abort_one(client, rng, stages[i % len(stages)])
                        for i in range(start, min(count, start + 48))]
                for got in await asyncio.gather(*wave):
                    outcomes[got] = outcomes.get(got, 0) + 1
            gauges = await _settled(client)
            after = (await client.post("/v1/completions", json=probe)).json()
            reset = (await client.post("/reset_prefix_cache")).json()["success"]
            again = (await client.post("/v1/completions", json=probe)).json()
            return (outcomes, gauges, before["choices"][0]["text"],
                    after["choices"][0]["text"] + "|" + again["choices"][0]["text"], reset)

    outcomes, gauges, before, after, reset = asyncio.run(run())
    assert sum(outcomes.values()) == count
    assert gauges == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
                      "vllm:kv_cache_usage_perc": 0}, gauges
    # the prefix cache gives back what was computed, and no block was left held
    assert after == f"{before}|{before}"
    assert reset is True
    figures(f"{count} streams aborted ({', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}"
            f"): running, waiting and KV usage back to 0; cached prefix reused with the same "
            f"greedy text; prefix cache reset succeeded (no block held)")


def test_soak_keeps_memory_flat(load_server, request, figures):
    count = request.config.getoption("--soak-requests")
    server_pid = load_server.proc.pid
    core_pid = engine_core_pid(server_pid)
    samples: list[tuple[int, int, int]] = []  # (requests done, server rss, core rss)

    async def run() -> float:
        done = 0
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=load_server.url, timeout=60,
                                     limits=limits) as client:
            async def worker() -> None:
                nonlocal done
                while not queue.empty():
                    i = queue.get_nowait()
                    r = await client.post("/v1/completions", json={
                        "prompt": f"soak {i % 97}", "max_tokens": 2, **GREEDY})
                    assert r.status_code == 200, r.text
                    done += 1
                    if done % max(1, count // 20) == 0:
                        samples.append((done, rss_bytes(server_pid), rss_bytes(core_pid)))

            started = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(32)))
            return time.monotonic() - started

    wall = asyncio.run(run())
    warm = [s for s in samples if s[0] >= count // 5]  # after the first fifth: warmed up
    base_server, base_core = warm[0][1], warm[0][2]
    growth_server = max(s[1] for s in warm) / base_server - 1
    growth_core = max(s[2] for s in warm) / base_core - 1
    figures(f"{count} requests at concurrency 32 in {wall:.1f} s ({count / wall:.0f} req/s); "
            f"RSS after warm-up: API server {base_server / 2**20:.0f} MiB, growth "
            f"{growth_server:+.2%}; engine core {base_core / 2**20:.0f} MiB, growth "
            f"{growth_core:+.2%}")
    assert growth_server <= 0.05 and growth_core <= 0.05


def test_concurrent_greedy_matches_one_at_a_time(server, figures):
    """64 requests at once on the real SmolLM2 checkpoint give the text each gives alone."""
    prompts = [f"Write one sentence about the number {i}." for i in range(64)]

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        r = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run() -> tuple[list[str], list[str], float, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            t0 = time.monotonic()
            alone = [await one(client, p) for p in prompts]
            t1 = time.monotonic()
            together = await asyncio.gather(*(one(client, p) for p in prompts))
            return alone, list(together), t1 - t0, time.monotonic() - t1

    alone, together, t_alone, t_together = asyncio.run(run())
    same = sum(a == b for a, b in zip(alone, together))
    figures(f"64 greedy requests: {same}/64 identical to one at a time "
            f"({t_alone:.1f} s one by one, {t_together:.1f} s at once)")
    assert same == 64, [(a, b) for a, b in zip(alone, together) if a != b][:3]
    assert len(set(alone)) > 1  # the prompts are told apart
