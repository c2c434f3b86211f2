"""The prefix-cache counters fed from the engine's running totals in SchedulerStats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from vllmpy.core.sched_output import SchedulerStats
from vllmpy.metrics import PrometheusStatLogger
from vllmpy.outputs import IterationStats

MODEL = "tiny-model"


def counters(logger: PrometheusStatLogger) -> tuple[float, float]:
    body, _ = logger.render()
    found = {s.name: s.value for f in text_string_to_metric_families(body.decode())
             for s in f.samples if s.labels.get("model_name") == MODEL}
    return found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"]


def stats(queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(prefix_cache_queries_total=queries, prefix_cache_hits_total=hits)


def test_running_totals_become_counter_increments():
    logger = PrometheusStatLogger(MODEL, max_model_len=4096)
    assert counters(logger) == (0, 0)
    logger.record_scheduler(stats(100, 0))
    logger.record_scheduler(stats(100, 0))  # a step with no admission: nothing new
    logger.record_scheduler(stats(250, 96))
    assert counters(logger) == (250, 96)
    # a restarted engine reports from zero again: all of it is new
    logger.record_scheduler(stats(40, 32))
    assert counters(logger) == (290, 128)
    logger.listener(stats(90, 64), IterationStats())
    assert counters(logger) == (340, 160)
