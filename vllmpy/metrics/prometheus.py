"""Prometheus collectors with vLLM's ``vllm:*`` names, fed from the engine frontend.

``PrometheusStatLogger`` turns two streams into metrics, both fed once per batch of
engine-core outputs (``listener``):

- scheduler snapshots: queue lengths, KV-cache usage, preemptions, prefix-cache lookups
  and the number of tokens the step computed;
- ``IterationStats``: the prompt and generated tokens of the batch (counted as they are
  computed, not when their request ends), first-token and inter-token latencies, and
  each request that ended, however it ended (``finished_reason`` stop, length, abort or
  error), with its phase times and sizes.

Names, metric types, help texts, labels (``model_name`` and ``engine``) and histogram
buckets follow vLLM so that dashboards built for vLLM work unchanged; the body is served
in the Prometheus text format 0.0.4. Each logger owns its own ``CollectorRegistry``
unless one is passed in, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from vllmpy.core.sched_output import SchedulerStats, SpecDecodingStats
from vllmpy.outputs import FinishedRequestStats, IterationStats

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
# The n request parameter.
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
# The one engine this server runs: vLLM labels every series with its engine index.
ENGINE_INDEX = "0"


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


class PrometheusStatLogger:
    """vLLM's Prometheus metrics for one served model.

    Contract: ``listener(stats, iteration)`` is called once per batch of engine-core
    outputs, in order, with the scheduler's latest snapshot (or None) and what the batch
    did; a request's end arrives exactly once, in some batch's ``iteration.finished``.
    The logger keeps no per-request state. ``render`` produces the ``/metrics`` body and
    its content type; ``engine_stopped`` zeroes the gauges of a dead engine.
    """

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.model_name = model_name
        self.labels = (model_name, ENGINE_INDEX)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._last_preemptions_total = 0
        self._last_prefix_cache_totals = (0, 0)  # (queries, hits) the engine last reported
        self._last_spec: SpecDecodingStats | None = None  # the totals the engine last reported
        self._spec_declared = False
        self._declare_scheduler_metrics()
        self._declare_token_metrics()
        self._declare_request_metrics(max_model_len)

    # ---- declarations -------------------------------------------------------------------

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name", "engine"], registry=self.registry)

    def _counter(self, name: str, doc: str, extra_labels: Sequence[str] = ()) -> Counter:
        return Counter(name, doc, ["model_name", "engine", *extra_labels],
                       registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, doc, ["model_name", "engine"], buckets=buckets,
                         registry=self.registry)

    def _declare_scheduler_metrics(self) -> None:
        labels = self.labels
        self.gauge_running = self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.").labels(*labels)
        self.gauge_waiting = self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.").labels(*labels)
        self.gauge_kv_cache_usage = self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.").labels(*labels)
        self.counter_preemptions = self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.").labels(*labels)
        self.counter_prefix_cache_queries = self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.").labels(*labels)
        self.counter_prefix_cache_hits = self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.").labels(*labels)
        self.histogram_iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS).labels(*labels)

    def _declare_token_metrics(self) -> None:
        labels = self.labels
        self.counter_prompt_tokens = self._counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*labels)
        self.counter_generation_tokens = self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.").labels(*labels)
        self.histogram_ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", TTFT_BUCKETS).labels(*labels)
        self.histogram_itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", ITL_BUCKETS).labels(*labels)

    def _declare_request_metrics(self, max_model_len: int) -> None:
        labels = self.labels
        token_buckets = build_1_2_5_buckets(max_model_len)
        success = self._counter("vllm:request_success",
                                "Count of successfully processed requests.",
                                ["finished_reason"])
        # Every reason is created up front so each series reads 0 before its first request.
        self.counter_request_success = {
            reason: success.labels(*labels, reason) for reason in FINISHED_REASONS}
        self._request_success_family = success
        latency = [
            ("e2e", "vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds."),
            ("queue", "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request."),
            ("inference", "vllm:request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request."),
            ("decode", "vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request."),
        ]
        self.histogram_phase = {key: self._histogram(name, doc, REQUEST_LATENCY_BUCKETS)
                                .labels(*labels) for key, name, doc in latency}
        self.histogram_tpot = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS).labels(*labels)
        sizes = [
            ("prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
             token_buckets),
            ("generation", "vllm:request_generation_tokens",
             "Number of generation tokens processed.", token_buckets),
            ("max_num_generation", "vllm:request_max_num_generation_tokens",
             "Histogram of maximum number of requested generation tokens.", token_buckets),
            ("max_tokens", "vllm:request_params_max_tokens",
             "Histogram of the max_tokens request parameter.", token_buckets),
            ("n", "vllm:request_params_n", "Histogram of the n request parameter.",
             REQUEST_PARAMS_N_BUCKETS),
        ]
        self.histogram_size = {key: self._histogram(name, doc, buckets).labels(*labels)
                               for key, name, doc, buckets in sizes}

    # ---- feeding --------------------------------------------------------------------

    def listener(self, stats: SchedulerStats | None, iteration: IterationStats) -> None:
        """The engine-frontend callback: one scheduler snapshot and what the batch did."""
        if stats is not None:
            self.record_scheduler(stats)
        self.record_iteration(iteration)

    def record_scheduler(self, stats: SchedulerStats) -> None:
        """Set the gauges from one engine snapshot and count what the step did."""
        with self._lock:
            self.gauge_running.set(stats.num_running_reqs)
            self.gauge_waiting.set(stats.num_waiting_reqs)
            self.gauge_kv_cache_usage.set(stats.kv_cache_usage)
            # The engine reports a running total; a smaller one means it restarted.
            delta = stats.num_preemptions_total - self._last_preemptions_total
            if delta < 0:
                delta = stats.num_preemptions_total
            if delta > 0:
                self.counter_preemptions.inc(delta)
            self._last_preemptions_total = stats.num_preemptions_total
            if stats.num_scheduled_tokens:
                self.histogram_iteration_tokens.observe(stats.num_scheduled_tokens)
            self._record_prefix_cache_totals(stats.prefix_cache_queries_total,
                                             stats.prefix_cache_hits_total)
            if stats.spec_decoding is not None:
                self._record_spec_totals(stats.spec_decoding)

    def record_iteration(self, iteration: IterationStats) -> None:
        """Count one batch's tokens and latencies, and the requests that ended in it."""
        with self._lock:
            if iteration.num_prompt_tokens:
                self.counter_prompt_tokens.inc(iteration.num_prompt_tokens)
            if iteration.num_generation_tokens:
                self.counter_generation_tokens.inc(iteration.num_generation_tokens)
            for ttft in iteration.time_to_first_tokens:
                self.histogram_ttft.observe(ttft)
            for itl in iteration.inter_token_latencies:
                self.histogram_itl.observe(itl)
            for ended in iteration.finished:
                self._record_finished(ended)

    def engine_stopped(self) -> None:
        """The engine core is gone: nothing runs, waits or holds KV blocks any more."""
        with self._lock:
            self.gauge_running.set(0)
            self.gauge_waiting.set(0)
            self.gauge_kv_cache_usage.set(0)

    def render(self) -> tuple[bytes, str]:
        """The ``/metrics`` response body and its content type (text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

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

    def _declare_spec_metrics(self) -> None:
        """vLLM's spec_decode counters, exported once an engine reports speculative
        decoding (an engine without it has none)."""
        labels = self.labels
        self.counter_spec_drafts = self._counter(
            "vllm:spec_decode_num_drafts",
            "Number of spec decoding drafts.").labels(*labels)
        self.counter_spec_draft_tokens = self._counter(
            "vllm:spec_decode_num_draft_tokens",
            "Number of draft tokens.").labels(*labels)
        self.counter_spec_accepted_tokens = self._counter(
            "vllm:spec_decode_num_accepted_tokens",
            "Number of accepted tokens.").labels(*labels)
        self._spec_per_pos_family = self._counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", ("position",))

    def _record_spec_totals(self, spec: SpecDecodingStats) -> None:
        """Count the speculative-decoding totals' growth since the last report (all of
        them after a restart, when they go down)."""
        if self._last_spec is None and not self._spec_declared:
            self._declare_spec_metrics()
            self._spec_declared = True
        last = self._last_spec
        if last is None or spec.num_drafts < last.num_drafts:
            last = SpecDecodingStats()
        self._last_spec = spec
        for counter, now, before in (
                (self.counter_spec_drafts, spec.num_drafts, last.num_drafts),
                (self.counter_spec_draft_tokens, spec.num_draft_tokens, last.num_draft_tokens),
                (self.counter_spec_accepted_tokens, spec.num_accepted_tokens,
                 last.num_accepted_tokens)):
            if now > before:
                counter.inc(now - before)
        old = last.num_accepted_tokens_per_pos
        for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
            grown = count - (old[pos] if pos < len(old) else 0)
            child = self._spec_per_pos_family.labels(*self.labels, str(pos))
            if grown > 0:
                child.inc(grown)

    def _record_finished(self, ended: FinishedRequestStats) -> None:
        counter = self.counter_request_success.get(ended.finish_reason)
        if counter is None:  # a reason outside vLLM's four still gets its own series
            counter = self._request_success_family.labels(*self.labels, ended.finish_reason)
        counter.inc()
        m = ended.metrics
        end = m.finished_time if m.finished_time is not None else m.arrival_time
        phases = {"e2e": end - m.arrival_time}
        if m.first_scheduled_time is not None:
            phases["queue"] = m.first_scheduled_time - m.arrival_time
            phases["inference"] = end - m.first_scheduled_time
            if m.first_token_time is not None:
                phases["prefill"] = m.first_token_time - m.first_scheduled_time
        if m.first_token_time is not None:
            phases["decode"] = end - m.first_token_time
            if m.num_generation_tokens > 1:
                self.histogram_tpot.observe(
                    max(phases["decode"], 0.0) / (m.num_generation_tokens - 1))
        for key, seconds in phases.items():
            self.histogram_phase[key].observe(max(seconds, 0.0))
        sizes = {"prompt": m.num_prompt_tokens, "generation": m.num_generation_tokens,
                 "max_num_generation": ended.max_tokens, "max_tokens": ended.max_tokens,
                 "n": ended.n}
        for key, value in sizes.items():
            self.histogram_size[key].observe(value)
