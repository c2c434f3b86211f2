"""Prometheus collectors with vLLM's ``vllm:*`` names, fed from the engine frontend.

``PrometheusStatLogger`` turns two streams into metrics:

- scheduler snapshots (one per engine step or per batch of steps): queue lengths, KV-cache
  usage, preemptions and the number of tokens the step computed;
- ``RequestOutput``s as the frontend hands them out: token counts and per-request
  latencies, read from the output's ``metrics`` timestamps.

Names, metric types, help texts and histogram buckets follow vLLM so that dashboards built
for vLLM work unchanged. Every metric carries a ``model_name`` label. Each logger owns its
own ``CollectorRegistry`` unless one is passed in, so several servers (or tests) in one
process never collide.

Any field that is missing or None is skipped rather than guessed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from vllmpy.core.sched_output import SchedulerStats
from vllmpy.outputs import RequestMetrics, RequestOutput

# vLLM turns off the ``*_created`` series of counters and histograms; match its exposition.
prometheus_client.disable_created_metrics()

FINISHED_REASONS = ("stop", "length", "abort", "error")

# Seconds from arrival to the first generated token.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
# Seconds between two consecutive generated tokens of one request.
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
# Seconds a whole request (or one phase of it, such as queueing) takes.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# Tokens computed in one engine step (vLLM's choice when no CUDA-graph sizes are given).
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (e.g. 100 -> 1..100)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


# What the logger reads. It uses getattr with defaults, so tests may feed look-alikes.
SchedulerStatsLike = SchedulerStats
RequestOutputLike = RequestOutput
RequestMetricsLike = RequestMetrics


@dataclass
class _RequestProgress:
    """What has already been counted for one in-flight request."""

    num_generation_tokens: int = 0
    first_token_seen: bool = False


class PrometheusStatLogger:
    """vLLM's Prometheus metrics for one served model.

    Contract: ``record_scheduler`` takes engine snapshots in order; ``record_output`` takes
    every ``RequestOutput`` of every request, in order per request, ending with the one
    marked ``finished``. Per-request bookkeeping lives only between a request's first and
    its finished output. ``listener`` is the callback form of both; ``render`` produces the
    ``/metrics`` body and its content type.
    """

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestProgress] = {}
        self._last_preemptions_total = 0
        self._last_prefix_cache_totals = (0, 0)  # (queries, hits) the engine last reported
        self._declare_scheduler_metrics()
        self._declare_request_metrics(max_model_len)

    # ---- declarations -------------------------------------------------------------------

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry)

    def _counter(self, name: str, doc: str, extra_labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, ["model_name", *extra_labels], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _declare_scheduler_metrics(self) -> None:
        model = self.model_name
        self.gauge_running = self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.").labels(model)
        self.gauge_waiting = self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.").labels(model)
        self.gauge_kv_cache_usage = self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.").labels(model)
        self.counter_preemptions = self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.").labels(model)
        self.counter_prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(model)
        self.counter_prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.").labels(model)
        self.histogram_iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS).labels(model)

    def _declare_request_metrics(self, max_model_len: int) -> None:
        model = self.model_name
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.counter_prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.").labels(model)
        self.counter_generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.").labels(model)
        success = self._counter("vllm:request_success",
                                "Count of successfully processed requests.",
                                ["finished_reason"])
        # Every reason is created up front so each series reads 0 before its first request.
        self.counter_request_success = {
            reason: success.labels(model, reason) for reason in FINISHED_REASONS}
        self._request_success_family = success
        self.histogram_ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", TTFT_BUCKETS).labels(model)
        self.histogram_itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", ITL_BUCKETS).labels(model)
        self.histogram_e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS).labels(model)
        self.histogram_queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS).labels(model)
        self.histogram_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.", token_buckets).labels(model)
        self.histogram_generation_tokens = self._histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.", token_buckets).labels(model)

    # ---- feeding --------------------------------------------------------------------

    def record_scheduler(self, stats: SchedulerStatsLike) -> None:
        """Set the gauges from one engine snapshot and count what the step did."""
        running = getattr(stats, "num_running_reqs", None)
        waiting = getattr(stats, "num_waiting_reqs", None)
        usage = getattr(stats, "kv_cache_usage", None)
        preemptions = getattr(stats, "num_preemptions_total", None)
        scheduled = getattr(stats, "num_scheduled_tokens", None)
        queries = getattr(stats, "prefix_cache_queries_total", None)
        hits = getattr(stats, "prefix_cache_hits_total", None)
        with self._lock:
            if running is not None:
                self.gauge_running.set(running)
            if waiting is not None:
                self.gauge_waiting.set(waiting)
            if usage is not None:
                self.gauge_kv_cache_usage.set(usage)
            if preemptions is not None:
                # The engine reports a running total; a smaller one means it restarted.
                delta = preemptions - self._last_preemptions_total
                if delta < 0:
                    delta = preemptions
                if delta > 0:
                    self.counter_preemptions.inc(delta)
                self._last_preemptions_total = preemptions
            if scheduled:
                self.histogram_iteration_tokens.observe(scheduled)
            if queries is not None and hits is not None:
                self._record_prefix_cache_totals(queries, hits)

    def engine_stopped(self) -> None:
        """The engine core is gone: nothing runs, waits or holds KV blocks any more."""
        with self._lock:
            self.gauge_running.set(0)
            self.gauge_waiting.set(0)
            self.gauge_kv_cache_usage.set(0)

    def record_prefix_cache(self, queries: int, hits: int) -> None:
        """Count tokens looked up in the prefix cache and how many of them were cached."""
        if queries > 0:
            self.counter_prefix_cache_queries.inc(queries)
        if hits > 0:
            self.counter_prefix_cache_hits.inc(hits)

    def record_output(self, out: RequestOutputLike) -> None:
        """Count one ``RequestOutput``: tokens as they arrive, latencies once known."""
        metrics: RequestMetricsLike | None = getattr(out, "metrics", None)
        with self._lock:
            progress = self._requests.get(out.request_id)
            if progress is None:
                progress = _RequestProgress()
                self._requests[out.request_id] = progress
                self._count_prompt(out, metrics)
            if metrics is not None:
                self._record_progress(progress, metrics)
            if out.finished:
                del self._requests[out.request_id]
                self._record_finished(out, metrics)

    def listener(self, stats: SchedulerStatsLike | None,
                 outputs: Iterable[RequestOutputLike]) -> None:
        """The engine-frontend callback: one scheduler snapshot and the outputs it made."""
        if stats is not None:
            self.record_scheduler(stats)
        for out in outputs:
            self.record_output(out)

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` response body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    @property
    def num_tracked_requests(self) -> int:
        """Requests seen but not yet finished (what the logger still holds state for)."""
        return len(self._requests)

    # ---- helpers (called under the lock) ----------------------------------------------

    def _record_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """The engine reports running totals; count what is new since the last report
        (all of it after a restart, when the totals go down)."""
        last_queries, last_hits = self._last_prefix_cache_totals
        if queries < last_queries or hits < last_hits:
            last_queries, last_hits = 0, 0
        self._last_prefix_cache_totals = (queries, hits)
        if queries > last_queries:
            self.counter_prefix_cache_queries.inc(queries - last_queries)
        if hits > last_hits:
            self.counter_prefix_cache_hits.inc(hits - last_hits)

    def _count_prompt(self, out: RequestOutputLike,
                      metrics: RequestMetricsLike | None) -> None:
        num_prompt = getattr(metrics, "num_prompt_tokens", None)
        if num_prompt is None:
            prompt_ids = getattr(out, "prompt_token_ids", None)
            num_prompt = len(prompt_ids) if prompt_ids is not None else None
        if num_prompt:
            self.counter_prompt_tokens.inc(num_prompt)

    def _record_progress(self, progress: _RequestProgress,
                         metrics: RequestMetricsLike) -> None:
        num_generated = getattr(metrics, "num_generation_tokens", None)
        if num_generated is not None and num_generated > progress.num_generation_tokens:
            self.counter_generation_tokens.inc(num_generated - progress.num_generation_tokens)
            progress.num_generation_tokens = num_generated
        arrival = getattr(metrics, "arrival_time", None)
        first_token = getattr(metrics, "first_token_time", None)
        if not progress.first_token_seen and first_token is not None:
            progress.first_token_seen = True
            if arrival is not None:
                self.histogram_ttft.observe(max(first_token - arrival, 0.0))
        for latency in getattr(metrics, "inter_token_latencies", None) or ():
            self.histogram_itl.observe(latency)

    def _record_finished(self, out: RequestOutputLike,
                         metrics: RequestMetricsLike | None) -> None:
        reason = next((o.finish_reason for o in out.outputs if o.finish_reason), "abort")
        counter = self.counter_request_success.get(reason)
        if counter is None:  # a reason outside vLLM's four still gets its own series
            counter = self._request_success_family.labels(self.model_name, reason)
        counter.inc()
        if metrics is None:
            return
        arrival = getattr(metrics, "arrival_time", None)
        finished = getattr(metrics, "finished_time", None)
        scheduled = getattr(metrics, "first_scheduled_time", None)
        if arrival is not None and finished is not None:
            self.histogram_e2e.observe(max(finished - arrival, 0.0))
        if arrival is not None and scheduled is not None:
            self.histogram_queue_time.observe(max(scheduled - arrival, 0.0))
        num_prompt = getattr(metrics, "num_prompt_tokens", None)
        if num_prompt is not None:
            self.histogram_prompt_tokens.observe(num_prompt)
        num_generated = getattr(metrics, "num_generation_tokens", None)
        if num_generated is not None:
            self.histogram_generation_tokens.observe(num_generated)
