"""PrometheusStatLogger: vLLM names, exact counts and latencies, no per-request leak."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from vllmpy.metrics import PrometheusStatLogger, build_1_2_5_buckets

MODEL = "tiny-model"

# name as declared -> (type, names of its samples that must carry model_name)
EXPECTED = {
    "vllm:num_requests_running": ("gauge", ["vllm:num_requests_running"]),
    "vllm:num_requests_waiting": ("gauge", ["vllm:num_requests_waiting"]),
    "vllm:kv_cache_usage_perc": ("gauge", ["vllm:kv_cache_usage_perc"]),
    "vllm:num_preemptions": ("counter", ["vllm:num_preemptions_total"]),
    "vllm:prompt_tokens": ("counter", ["vllm:prompt_tokens_total"]),
    "vllm:generation_tokens": ("counter", ["vllm:generation_tokens_total"]),
    "vllm:request_success": ("counter", ["vllm:request_success_total"]),
    "vllm:prefix_cache_queries": ("counter", ["vllm:prefix_cache_queries_total"]),
    "vllm:prefix_cache_hits": ("counter", ["vllm:prefix_cache_hits_total"]),
}
for _name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:iteration_tokens_total"):
    EXPECTED[_name] = ("histogram", [f"{_name}_bucket", f"{_name}_sum", f"{_name}_count"])


@dataclass
class Stats:
    num_running_reqs: int | None = 0
    num_waiting_reqs: int | None = 0
    kv_cache_usage: float | None = 0.0
    num_preemptions_total: int | None = 0
    num_scheduled_tokens: int | None = 0


@dataclass
class Metrics:
    arrival_time: float | None = 100.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int | None = 7
    num_generation_tokens: int | None = 0
    inter_token_latencies: list[float] | None = field(default_factory=list)


def make_output(req_id: str, metrics: Metrics | None, finish_reason: str | None = None,
                prompt_len: int = 7) -> SimpleNamespace:
    completion = SimpleNamespace(index=0, finish_reason=finish_reason)
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(prompt_len)),
                           outputs=[completion], finished=finish_reason is not None,
                           metrics=metrics)


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """Every sample of the rendered text, keyed by (sample name, sorted labels)."""
    body, _ = logger.render()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
    return samples(logger)[key]


def hist(logger: PrometheusStatLogger, name: str) -> tuple[float, float]:
    """(sum, count) of one histogram."""
    return value(logger, f"{name}_sum"), value(logger, f"{name}_count")


@pytest.fixture
def logger() -> PrometheusStatLogger:
    return PrometheusStatLogger(MODEL, max_model_len=4096)


def test_every_metric_is_declared_with_its_type_and_model_label(logger):
    body, content_type = logger.render()
    assert content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, (kind, sample_names) in EXPECTED.items():
        # The parser strips a counter's _total suffix from the family name.
        family = families[name]
        assert family.type == kind, name
        seen = {s.name for s in family.samples}
        assert set(sample_names) <= seen, (name, seen)
        assert all(s.labels["model_name"] == MODEL for s in family.samples), name
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)


def test_bucket_choices():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(1) == [1]
    logger = PrometheusStatLogger(MODEL, max_model_len=300)
    les = {dict(labels)["le"] for (name, labels) in samples(logger)
           if name == "vllm:request_prompt_tokens_bucket"}
    assert les == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"}
    with pytest.raises(ValueError, match="max_model_len"):
        PrometheusStatLogger(MODEL, max_model_len=0)


def test_gauges_follow_latest_stats_and_preemptions_count_deltas(logger):
    logger.record_scheduler(Stats(3, 5, 0.25, 2, 64))
    logger.record_scheduler(Stats(1, 0, 0.5, 2, 0))  # no new preemption, idle step
    logger.record_scheduler(Stats(4, 2, 0.75, 5, 17))
    assert value(logger, "vllm:num_requests_running") == 4
    assert value(logger, "vllm:num_requests_waiting") == 2
    assert value(logger, "vllm:kv_cache_usage_perc") == 0.75
    assert value(logger, "vllm:num_preemptions_total") == 5
    # Steps that computed nothing are not observed.
    assert hist(logger, "vllm:iteration_tokens_total") == (81, 2)
    cumulative = [value(logger, "vllm:iteration_tokens_total_bucket", le=le)
                  for le in ("16.0", "32.0", "64.0")]
    assert cumulative == [0, 1, 2]
    # None fields leave the previous values alone.
    logger.record_scheduler(Stats(None, None, None, None, None))
    assert value(logger, "vllm:num_requests_running") == 4
    assert value(logger, "vllm:num_preemptions_total") == 5
    # An engine restart resets its running total; the counter keeps rising.
    logger.record_scheduler(Stats(num_preemptions_total=1))
    assert value(logger, "vllm:num_preemptions_total") == 6


def test_one_request_counts_tokens_and_latencies_exactly(logger):
    m = Metrics(arrival_time=100.0, first_scheduled_time=100.5, num_prompt_tokens=7)
    m.first_token_time, m.num_generation_tokens = 101.25, 1
    logger.record_output(make_output("a", m))
    m.num_generation_tokens, m.inter_token_latencies = 3, [0.5, 0.25]
    logger.record_output(make_output("a", m))
    m.num_generation_tokens, m.inter_token_latencies = 4, [0.125]
    m.finished_time = 103.0
    logger.record_output(make_output("a", m, finish_reason="length"))

    assert value(logger, "vllm:prompt_tokens_total") == 7  # once, not per output
    assert value(logger, "vllm:generation_tokens_total") == 4
    assert hist(logger, "vllm:time_to_first_token_seconds") == (1.25, 1)
    assert hist(logger, "vllm:inter_token_latency_seconds") == (0.875, 3)
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (3.0, 1)
    assert hist(logger, "vllm:request_queue_time_seconds") == (0.5, 1)
    assert hist(logger, "vllm:request_prompt_tokens") == (7, 1)
    assert hist(logger, "vllm:request_generation_tokens") == (4, 1)
    assert value(logger, "vllm:request_success_total", finished_reason="length") == 1
    assert value(logger, "vllm:request_success_total", finished_reason="stop") == 0
    assert logger.num_tracked_requests == 0


def test_many_requests_sum_and_label_by_reason(logger):
    for i, reason in enumerate(["stop", "stop", "length", "abort", "error"]):
        m = Metrics(arrival_time=10.0 * i, first_scheduled_time=10.0 * i + 0.5,
                    num_prompt_tokens=10 + i)
        m.first_token_time, m.num_generation_tokens = 10.0 * i + 1.0, 2
        logger.record_output(make_output(f"r{i}", m))
        m.num_generation_tokens, m.finished_time = 5, 10.0 * i + 2.0
        logger.record_output(make_output(f"r{i}", m, finish_reason=reason))
    assert logger.num_tracked_requests == 0
    assert value(logger, "vllm:prompt_tokens_total") == 10 + 11 + 12 + 13 + 14
    assert value(logger, "vllm:generation_tokens_total") == 25
    assert hist(logger, "vllm:time_to_first_token_seconds") == (5.0, 5)
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (10.0, 5)
    assert hist(logger, "vllm:request_queue_time_seconds") == (2.5, 5)
    counts = {r: value(logger, "vllm:request_success_total", finished_reason=r)
              for r in ("stop", "length", "abort", "error")}
    assert counts == {"stop": 2, "length": 1, "abort": 1, "error": 1}


def test_state_is_held_only_while_a_request_runs(logger):
    m_a, m_b = Metrics(num_generation_tokens=1), Metrics(num_generation_tokens=1)
    logger.record_output(make_output("a", m_a))
    logger.record_output(make_output("b", m_b))
    assert logger.num_tracked_requests == 2
    logger.record_output(make_output("a", m_a, finish_reason="stop"))
    assert logger.num_tracked_requests == 1
    logger.record_output(make_output("b", m_b, finish_reason="abort"))
    assert logger.num_tracked_requests == 0
    # A request whose only output is its last one leaves nothing behind either.
    logger.record_output(make_output("c", Metrics(), finish_reason="abort"))
    assert logger.num_tracked_requests == 0
    assert value(logger, "vllm:prompt_tokens_total") == 21


def test_missing_metrics_fields_are_skipped(logger):
    # No metrics object at all: prompt length comes from the token ids, the finish counts.
    logger.record_output(make_output("a", None, prompt_len=5))
    logger.record_output(make_output("a", None, finish_reason="stop", prompt_len=5))
    assert value(logger, "vllm:prompt_tokens_total") == 5
    assert value(logger, "vllm:request_success_total", finished_reason="stop") == 1
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (0, 0)
    # Metrics with holes: only what is known is observed.
    m = Metrics(arrival_time=None, first_token_time=3.0, finished_time=4.0,
                num_prompt_tokens=None, num_generation_tokens=None,
                inter_token_latencies=None)
    logger.record_output(make_output("b", m, finish_reason="length", prompt_len=2))
    assert value(logger, "vllm:prompt_tokens_total") == 7
    assert value(logger, "vllm:generation_tokens_total") == 0
    assert hist(logger, "vllm:time_to_first_token_seconds") == (0, 0)
    assert hist(logger, "vllm:request_prompt_tokens") == (0, 0)
    assert logger.num_tracked_requests == 0


def test_listener_feeds_both(logger):
    m = Metrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.5,
                finished_time=1.0, num_prompt_tokens=3, num_generation_tokens=1)
    logger.listener(Stats(num_running_reqs=1, num_scheduled_tokens=3),
                    [make_output("a", m, finish_reason="stop")])
    logger.listener(None, [])
    assert value(logger, "vllm:num_requests_running") == 1
    assert value(logger, "vllm:prompt_tokens_total") == 3
    assert value(logger, "vllm:request_success_total", finished_reason="stop") == 1


def test_prefix_cache_counters(logger):
    logger.record_prefix_cache(queries=64, hits=32)
    logger.record_prefix_cache(queries=16, hits=0)
    assert value(logger, "vllm:prefix_cache_queries_total") == 80
    assert value(logger, "vllm:prefix_cache_hits_total") == 32


def test_two_loggers_in_one_process_do_not_collide():
    a = PrometheusStatLogger("model-a", max_model_len=128)
    b = PrometheusStatLogger("model-b", max_model_len=128)
    a.record_scheduler(Stats(num_running_reqs=2))
    b.record_scheduler(Stats(num_running_reqs=9))
    assert ("vllm:num_requests_running", (("model_name", "model-a"),)) in samples(a)
    assert samples(a)[("vllm:num_requests_running", (("model_name", "model-a"),))] == 2
    assert samples(b)[("vllm:num_requests_running", (("model_name", "model-b"),))] == 9
    assert not any(dict(labels).get("model_name") == "model-b" for _, labels in samples(a))
    # A shared registry is used when given; one name can be registered there only once.
    shared = CollectorRegistry()
    PrometheusStatLogger("x", max_model_len=16, registry=shared)
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusStatLogger("y", max_model_len=16, registry=shared)


def test_engine_dataclasses_feed_the_logger(logger):
    # The frontend's own types, as the engine's stat listener hands them over.
    from vllmpy.core.sched_output import SchedulerStats
    from vllmpy.outputs import CompletionOutput, RequestMetrics, RequestOutput

    m = RequestMetrics(arrival_time=50.0, first_scheduled_time=50.25, first_token_time=50.5,
                       num_prompt_tokens=4, num_generation_tokens=1)
    first = RequestOutput("q", None, [1, 2, 3, 4], [CompletionOutput(0, "a", [9])], metrics=m)
    m_done = RequestMetrics(arrival_time=50.0, first_scheduled_time=50.25,
                            first_token_time=50.5, last_token_time=51.0, finished_time=51.0,
                            num_prompt_tokens=4, num_generation_tokens=2,
                            inter_token_latencies=[0.5])
    done = RequestOutput("q", None, [1, 2, 3, 4],
                         [CompletionOutput(0, "ab", [9, 8], finish_reason="stop")],
                         finished=True, metrics=m_done)
    stats = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.125, num_preemptions_total=1,
                           num_scheduled_tokens=4)
    logger.listener(stats, [first])
    logger.listener(SchedulerStats(num_preemptions_total=1, num_scheduled_tokens=1), [done])
    assert value(logger, "vllm:num_requests_running") == 0
    assert value(logger, "vllm:num_preemptions_total") == 1
    assert value(logger, "vllm:prompt_tokens_total") == 4
    assert value(logger, "vllm:generation_tokens_total") == 2
    assert hist(logger, "vllm:time_to_first_token_seconds") == (0.5, 1)
    assert hist(logger, "vllm:inter_token_latency_seconds") == (0.5, 1)
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (1.0, 1)
    assert hist(logger, "vllm:request_queue_time_seconds") == (0.25, 1)
    assert hist(logger, "vllm:iteration_tokens_total") == (5, 2)
    assert value(logger, "vllm:request_success_total", finished_reason="stop") == 1
    assert logger.num_tracked_requests == 0
