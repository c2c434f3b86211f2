"""MetricsHistory: rates from counter deltas, the newest samples of a window, percentiles
from bucket deltas as Prometheus's histogram_quantile reads them, restarts that never
give a negative rate, a bounded memory and thinned plot series; then /dashboard/data on
a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_utils import TINY_SERVER, start_server

from vllmpy.core.sched_output import SchedulerStats, SpecDecodingStats
from vllmpy.metrics import PrometheusStatLogger
from vllmpy.metrics.history import MAX_SERIES_POINTS, MetricsHistory, histogram_quantile
from vllmpy.metrics.prometheus import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from vllmpy.outputs import FinishedRequestStats, IterationStats, RequestMetrics


@pytest.fixture
def logger() -> PrometheusStatLogger:
    return PrometheusStatLogger("tiny-model", max_model_len=1024)


@pytest.fixture
def history(logger) -> MetricsHistory:
    return MetricsHistory(logger)


def batch(logger, *, gen=0, prompt=0, ttft=(), itl=(), finished=(), stats=None) -> None:
    """One batch of engine-core outputs, through the logger's own listener."""
    logger.listener(stats, IterationStats(
        num_generation_tokens=gen, num_prompt_tokens=prompt, time_to_first_tokens=list(ttft),
        inter_token_latencies=list(itl), finished=list(finished)))


def ended(reason: str, e2e: float = 2.0) -> FinishedRequestStats:
    m = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.0,
                       first_token_time=100.0 + e2e / 2, finished_time=100.0 + e2e,
                       num_prompt_tokens=4, num_generation_tokens=3)
    return FinishedRequestStats(reason, m, n=1, max_tokens=3)


def test_rates_are_counter_deltas_over_the_elapsed_time(logger, history):
    history.sample(now=100.0)
    batch(logger, gen=30, prompt=120)
    batch(logger, gen=20, prompt=80)
    history.sample(now=110.0)
    v = history.view(300)
    assert v["now"] == 110.0 and v["window_s"] == 10.0
    assert v["throughput"] == {"generation_tokens_per_s": 5.0, "prompt_tokens_per_s": 20.0,
                               "generation_tokens": 50.0, "prompt_tokens": 200.0}


def test_a_window_reads_only_its_newest_samples(logger, history):
    history.sample(now=100.0)
    batch(logger, gen=10)
    history.sample(now=110.0)
    batch(logger, gen=30)
    history.sample(now=120.0)
    for window, covered, rate in [(10, 10.0, 3.0), (15, 10.0, 3.0), (20, 20.0, 2.0),
                                  (3600, 20.0, 2.0)]:
        v = history.view(window)
        assert (v["window_s"], v["throughput"]["generation_tokens_per_s"]) == (covered, rate)


def test_gauges_are_the_newest_snapshot(logger, history):
    logger.record_scheduler(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.9))
    history.sample(now=1.0)
    logger.record_scheduler(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2,
                                           kv_cache_usage=0.25))
    history.sample(now=2.0)
    assert history.view(60)["gauges"] == {"running": 3.0, "waiting": 2.0,
                                          "kv_cache_usage": 0.25}


def test_percentiles_interpolate_inside_the_bucket_of_the_rank(logger, history):
    history.sample(now=0.0)
    # TTFT: ten observations in (0.04, 0.06]: rank q*10 lies 10q of the way up the bucket
    i = TTFT_BUCKETS.index(0.06)
    lo, hi = TTFT_BUCKETS[i - 1], TTFT_BUCKETS[i]
    assert lo == 0.04
    # ITL: four in (0, 0.01], six in (0.025, 0.05]: p50's rank 5 is the first of the six
    # (1/6 of the way up), p90's rank 9 the fifth, p99's rank 9.9 is 5.9/6 up
    batch(logger, ttft=[0.05] * 10, itl=[0.005] * 4 + [0.03] * 6)
    history.sample(now=1.0)
    latency = history.view(60)["latency"]
    assert latency["ttft"] == pytest.approx({"count": 10.0, "p50": lo + (hi - lo) * 0.5,
                                             "p90": lo + (hi - lo) * 0.9,
                                             "p99": lo + (hi - lo) * 0.99})
    assert latency["ttft"]["p50"] == pytest.approx(0.05)
    a, b = ITL_BUCKETS[1], ITL_BUCKETS[2]  # (0.025, 0.05]
    assert latency["itl"] == pytest.approx({"count": 10.0, "p50": a + (b - a) * 1 / 6,
                                            "p90": a + (b - a) * 5 / 6,
                                            "p99": a + (b - a) * 5.9 / 6}, rel=1e-5)


def test_the_first_bucket_starts_at_zero_and_the_inf_bucket_answers_its_lower_bound(
        logger, history):
    history.sample(now=0.0)
    batch(logger, itl=[0.001] * 10,  # all in (0, 0.01]
          finished=[ended("stop", e2e=10_000.0)])  # past the last finite e2e bound
    history.sample(now=1.0)
    latency = history.view(60)["latency"]
    assert latency["itl"]["p50"] == pytest.approx(ITL_BUCKETS[0] * 0.5)
    top = REQUEST_LATENCY_BUCKETS[-1]
    assert latency["e2e"] == {"count": 1.0, "p50": top, "p90": top, "p99": top}


def test_percentiles_count_only_the_windows_observations(logger, history):
    history.sample(now=0.0)
    batch(logger, ttft=[0.003] * 50)  # (0.001, 0.005], before the window below
    history.sample(now=10.0)
    batch(logger, ttft=[0.05] * 10)
    history.sample(now=20.0)
    assert history.view(10)["latency"]["ttft"]["p50"] == pytest.approx(0.05)
    assert history.view(20)["latency"]["ttft"]["count"] == 60.0


def test_nothing_observed_reads_as_none(history):
    history.sample(now=0.0)
    history.sample(now=5.0)
    v = history.view(60)
    for key in ("ttft", "itl", "e2e"):
        assert v["latency"][key] == {"count": 0.0, "p50": None, "p90": None, "p99": None}
    assert v["prefix_cache"] == {"hit_rate": None, "queries": 0.0, "hits": 0.0}
    assert v["throughput"]["generation_tokens_per_s"] == 0.0
    assert histogram_quantile(0.5, (1.0, float("inf")), (0.0, 0.0)) is None


def test_one_sample_has_no_rates_and_no_samples_answers_the_same_shape(logger, history):
    empty = history.view(60)
    history.sample(now=1.0)
    one = history.view(60)
    assert one["window_s"] == 0.0 and one["throughput"]["generation_tokens_per_s"] is None
    assert one["series"]["t"] == []
    assert empty["gauges"]["running"] is None
    assert set(empty) == set(one) and set(empty["series"]) == set(one["series"])
    assert empty["model"] == one["model"] == "tiny-model"  # the name /metrics labels
    json.dumps(empty, allow_nan=False)


def test_prefix_cache_hit_rate_is_hits_over_queries_in_the_window(logger, history):
    logger.record_scheduler(SchedulerStats(prefix_cache_queries_total=100,
                                           prefix_cache_hits_total=90))
    history.sample(now=0.0)
    logger.record_scheduler(SchedulerStats(prefix_cache_queries_total=300,
                                           prefix_cache_hits_total=140))
    history.sample(now=1.0)
    assert history.view(60)["prefix_cache"] == {"hit_rate": 0.25, "queries": 200.0,
                                                "hits": 50.0}


def test_finished_requests_by_reason_and_preemptions(logger, history):
    logger.record_scheduler(SchedulerStats(num_preemptions_total=2))
    batch(logger, finished=[ended("stop")])
    history.sample(now=0.0)
    logger.record_scheduler(SchedulerStats(num_preemptions_total=5))
    batch(logger, finished=[ended("stop"), ended("stop"), ended("length"), ended("abort")])
    history.sample(now=1.0)
    v = history.view(60)
    assert v["requests_finished"] == {"stop": 2.0, "length": 1.0, "abort": 1.0, "error": 0.0}
    assert v["preemptions"] == {"window": 3.0, "total": 5.0}


def test_a_counter_that_starts_over_gives_no_negative_rate(logger, history):
    batch(logger, gen=100)
    history.sample(now=0.0)
    batch(logger, gen=10)
    history.sample(now=1.0)
    logger.counter_generation_tokens.reset()  # as a logger that started over reads
    batch(logger, gen=7)
    history.sample(now=2.0)
    assert history.view(1)["throughput"]["generation_tokens"] == 7.0
    assert history.view(2)["throughput"]["generation_tokens"] == 17.0
    assert min(history.view(2)["series"]["generation_tokens_per_s"]) >= 0


def test_spec_decode_is_none_without_it_and_windowed_with_it(logger, history):
    history.sample(now=0.0)
    history.sample(now=1.0)
    assert history.view(60)["spec_decode"] is None
    # the engine reports running totals; the logger declares its counters on the first one
    logger.record_scheduler(SchedulerStats(spec_decoding=SpecDecodingStats(4, 12, 6, [4, 2])))
    history.sample(now=2.0)
    logger.record_scheduler(SchedulerStats(spec_decoding=SpecDecodingStats(10, 30, 21,
                                                                           [10, 8, 3])))
    history.sample(now=3.0)
    assert history.view(1)["spec_decode"] == pytest.approx({
        "acceptance_rate": 15 / 18, "mean_acceptance_length": 1 + 15 / 6, "drafts": 6.0,
        "draft_tokens": 18.0, "accepted_tokens": 15.0}, rel=1e-5)
    # a window starting before the counters existed counts them from zero
    assert history.view(60)["spec_decode"]["draft_tokens"] == 30.0


def test_the_horizon_bounds_the_memory(logger):
    history = MetricsHistory(logger, horizon_s=60.0)
    for t in range(201):
        history.sample(now=float(t))
    assert len(history.samples) == 61 and history.samples[0].t == 140.0
    assert history.view(3600)["window_s"] == 60.0


def test_a_clock_that_went_back_drops_the_newer_samples(history):
    for t in (10.0, 20.0, 30.0):
        history.sample(now=t)
    history.sample(now=15.0)
    assert [s.t for s in history.samples] == [10.0, 15.0]


def test_series_has_a_point_per_step_between_samples(logger, history):
    history.sample(now=0.0)
    for t, gen in ((1.0, 4), (2.0, 0), (4.0, 10)):
        logger.record_scheduler(SchedulerStats(num_running_reqs=int(t)))
        batch(logger, gen=gen, prompt=2 * gen)
        history.sample(now=t)
    assert history.view(60)["series"] == {
        "t": [1.0, 2.0, 4.0], "running": [1.0, 2.0, 4.0], "waiting": [0.0, 0.0, 0.0],
        "kv_cache_usage": [0.0, 0.0, 0.0], "generation_tokens_per_s": [4.0, 0.0, 5.0],
        "prompt_tokens_per_s": [8.0, 0.0, 10.0]}


def test_a_long_series_is_thinned_keeping_rates_and_peaks(logger):
    history = MetricsHistory(logger, horizon_s=2000.0)
    for t in range(1001):
        running = 9 if t == 500 else 1
        logger.record_scheduler(SchedulerStats(num_running_reqs=running))
        batch(logger, gen=3)
        history.sample(now=float(t))
    series = history.view(2000)["series"]
    assert MAX_SERIES_POINTS // 2 <= len(series["t"]) <= MAX_SERIES_POINTS
    assert series["t"][-1] == 1000.0 and series["t"] == sorted(series["t"])
    assert set(series["generation_tokens_per_s"]) == {3.0}  # each point: its step's rate
    assert max(series["running"]) == 9.0  # a one-sample peak survives the merge


def test_run_keeps_sampling_and_reports_a_failure_once(history, capsys, monkeypatch):
    calls = []

    def failing(now=None):
        calls.append(now)
        raise RuntimeError("collector gone")

    monkeypatch.setattr(history, "sample", failing)
    history.interval_s = 0.01

    async def drive() -> bool:
        task = asyncio.ensure_future(history.run())
        await asyncio.sleep(0.2)
        alive = not task.done()
        task.cancel()
        return alive

    assert asyncio.run(drive())
    assert len(calls) > 3
    err = capsys.readouterr().err
    assert err.count("collector gone") == 1


def test_bad_intervals_are_refused_by_name(logger):
    with pytest.raises(ValueError, match="interval_s"):
        MetricsHistory(logger, interval_s=0)


# ---- /dashboard/data on a real server ---------------------------------------------------

GREEDY = {"temperature": 0, "max_tokens": 6}
FORCED = 1000  # a token id every request below is pushed to, and stops on


@pytest.fixture(scope="module")
def dashboard_server(tiny_chat_model):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--max-model-len", "1024",
                     "--disable-log-requests")
    yield s
    s.stop()


def data(server, window="60") -> httpx.Response:
    return httpx.get(f"{server.url}/dashboard/data", params={"window": window}, timeout=10)


def wait_for_view(server, ready, timeout: float = 30.0) -> dict:
    """The first /dashboard/data answer ``ready`` accepts (the history samples each second)."""
    import time

    deadline = time.time() + timeout
    while True:
        view = data(server).json()
        if ready(view) or time.time() > deadline:
            return view
        time.sleep(0.25)


def test_dashboard_data_reflects_served_requests(dashboard_server):
    url = f"{dashboard_server.url}/v1/completions"
    for prompt in ("one", "two"):
        r = httpx.post(url, timeout=60, json={"prompt": prompt, "ignore_eos": True, **GREEDY})
        assert r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url, timeout=60, json={"prompt": "three", **GREEDY,
                                          "logit_bias": {str(FORCED): 100},
                                          "stop_token_ids": [FORCED]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    view = wait_for_view(dashboard_server,
                         lambda v: v["requests_finished"].get("stop", 0) >= 1
                         and v["requests_finished"].get("length", 0) >= 2)
    assert view["requests_finished"]["length"] >= 2 and view["requests_finished"]["stop"] >= 1
    assert view["throughput"]["generation_tokens"] >= 13
    assert view["throughput"]["generation_tokens_per_s"] > 0
    assert view["latency"]["ttft"]["p50"] is not None
    assert view["gauges"]["running"] == 0 and 0 < view["window_s"] <= 60
    assert max(view["series"]["generation_tokens_per_s"]) > 0


@pytest.mark.parametrize("window", ["0", "abc", "-5", "3601", "nan"])
def test_a_bad_window_is_refused_by_name(dashboard_server, window):
    r = data(dashboard_server, window)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "window" and "window" in r.json()["error"]["message"]


@pytest.mark.parametrize("flag, pages", [("--disable-metrics", ["/dashboard/data"]),
                                         ("--disable-web-ui", ["/dashboard",
                                                               "/dashboard/data"])])
def test_flags_take_the_dashboard_away_and_leave_the_api(tiny_chat_model, flag, pages):
    s = start_server("--model", tiny_chat_model, *TINY_SERVER, "--max-model-len", "1024",
                     "--disable-log-requests", flag)
    try:
        for path in pages:
            assert httpx.get(f"{s.url}{path}", timeout=10).status_code == 404, path
        assert httpx.get(f"{s.url}/v1/models", timeout=10).status_code == 200
    finally:
        s.stop()
