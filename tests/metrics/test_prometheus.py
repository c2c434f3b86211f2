"""PrometheusStatLogger: vLLM's names, types and labels, tokens counted per batch, every
request's end counted once with its phase times, text format 0.0.4."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllmpy.core.sched_output import SchedulerStats
from vllmpy.metrics import PrometheusStatLogger, build_1_2_5_buckets
from vllmpy.outputs import FinishedRequestStats, IterationStats, RequestMetrics

MODEL = "tiny-model"
LABELS = {"model_name": MODEL, "engine": "0"}

# name as declared -> (type, names of its samples)
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
              "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
              "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens",
              "vllm:request_params_n", "vllm:iteration_tokens_total"):
    EXPECTED[_name] = ("histogram", [f"{_name}_bucket", f"{_name}_sum", f"{_name}_count"])


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    """Every sample of the rendered text, keyed by (sample name, sorted labels)."""
    body, _ = logger.render()
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    return samples(logger)[(name, tuple(sorted({**LABELS, **labels}.items())))]


def hist(logger: PrometheusStatLogger, name: str) -> tuple[float, float]:
    """(sum, count) of one histogram."""
    return value(logger, f"{name}_sum"), value(logger, f"{name}_count")


@pytest.fixture
def logger() -> PrometheusStatLogger:
    return PrometheusStatLogger(MODEL, max_model_len=4096)


def ended(reason: str, *, arrival=100.0, scheduled=100.5, first=101.0, finished=103.0,
          prompt=7, generated=5, n=1, max_tokens=16) -> FinishedRequestStats:
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                       first_token_time=first, finished_time=finished,
                       num_prompt_tokens=prompt, num_generation_tokens=generated)
    return FinishedRequestStats(reason, m, n, max_tokens)


def test_every_metric_has_vllms_type_and_labels(logger):
    body, content_type = logger.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for name, (kind, sample_names) in EXPECTED.items():
        family = families[name]  # the parser strips a counter's _total from the family
        assert family.type == kind, name
        assert set(sample_names) <= {s.name for s in family.samples}, name
        for s in family.samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS, name
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
    logger.record_scheduler(SchedulerStats(3, 2, 0.25, 1, 40))
    logger.record_scheduler(SchedulerStats(1, 0, 0.5, 4, 8))
    assert value(logger, "vllm:num_requests_running") == 1
    assert value(logger, "vllm:num_requests_waiting") == 0
    assert value(logger, "vllm:kv_cache_usage_perc") == 0.5
    assert value(logger, "vllm:num_preemptions_total") == 4
    assert hist(logger, "vllm:iteration_tokens_total") == (48, 2)
    logger.record_scheduler(SchedulerStats(0, 0, 0, 2, 0))  # a restarted engine's total
    assert value(logger, "vllm:num_preemptions_total") == 6
    assert hist(logger, "vllm:iteration_tokens_total") == (48, 2)  # stats-only: no step
    logger.engine_stopped()
    logger.record_scheduler(SchedulerStats(0, 0, 0.0, 2))
    assert value(logger, "vllm:num_requests_running") == 0


def test_tokens_count_per_batch_not_at_the_end(logger):
    logger.listener(None, IterationStats(num_generation_tokens=1, num_prompt_tokens=7,
                                         time_to_first_tokens=[0.25]))
    assert value(logger, "vllm:prompt_tokens_total") == 7
    assert value(logger, "vllm:generation_tokens_total") == 1
    logger.listener(None, IterationStats(num_generation_tokens=3,
                                         inter_token_latencies=[0.01, 0.02, 0.03]))
    assert value(logger, "vllm:generation_tokens_total") == 4  # the request still runs
    assert hist(logger, "vllm:time_to_first_token_seconds") == (0.25, 1)
    assert hist(logger, "vllm:inter_token_latency_seconds") == pytest.approx((0.06, 3))
    assert value(logger, "vllm:request_success_total", finished_reason="length") == 0


def test_an_ended_request_counts_once_with_its_phases(logger):
    logger.record_iteration(IterationStats(finished=[ended("length", n=2, max_tokens=16)]))
    assert value(logger, "vllm:request_success_total", finished_reason="length") == 1
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (3.0, 1)
    assert hist(logger, "vllm:request_queue_time_seconds") == (0.5, 1)
    assert hist(logger, "vllm:request_inference_time_seconds") == (2.5, 1)
    assert hist(logger, "vllm:request_prefill_time_seconds") == (0.5, 1)
    assert hist(logger, "vllm:request_decode_time_seconds") == (2.0, 1)
    assert hist(logger, "vllm:request_time_per_output_token_seconds") == (0.5, 1)  # 2 s / 4
    assert hist(logger, "vllm:request_prompt_tokens") == (7, 1)
    assert hist(logger, "vllm:request_generation_tokens") == (5, 1)
    assert hist(logger, "vllm:request_params_max_tokens") == (16, 1)
    assert hist(logger, "vllm:request_params_n") == (2, 1)


def test_an_abort_before_the_first_token_counts_without_token_phases(logger):
    logger.record_iteration(IterationStats(finished=[
        ended("abort", scheduled=None, first=None, finished=100.25, generated=0)]))
    assert value(logger, "vllm:request_success_total", finished_reason="abort") == 1
    assert hist(logger, "vllm:e2e_request_latency_seconds") == (0.25, 1)
    assert hist(logger, "vllm:request_queue_time_seconds") == (0, 0)
    assert hist(logger, "vllm:request_decode_time_seconds") == (0, 0)
    assert hist(logger, "vllm:request_generation_tokens") == (0, 1)


def test_reasons_sum_and_an_unknown_reason_gets_its_own_series(logger):
    logger.record_iteration(IterationStats(finished=[ended("stop"), ended("stop"),
                                                     ended("error"), ended("repetition")]))
    assert value(logger, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(logger, "vllm:request_success_total", finished_reason="error") == 1
    assert value(logger, "vllm:request_success_total", finished_reason="repetition") == 1


def test_two_loggers_in_one_process_do_not_collide():
    a, b = PrometheusStatLogger("a", 128), PrometheusStatLogger("b", 128)
    a.record_iteration(IterationStats(num_generation_tokens=5))
    body_b = b.render()[0].decode()
    assert "vllm:generation_tokens_total{engine=\"0\",model_name=\"b\"} 0.0" in body_b
