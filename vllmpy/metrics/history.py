"""A short memory of ``/metrics`` for the dashboard: timestamped snapshots of the
``PrometheusStatLogger``'s collectors, turned into rates and windowed percentiles.

``sample`` reads the same numbers ``/metrics`` shows, straight from the logger's registry
(no text rendering), and appends one ``Snapshot`` to a deque that covers ``horizon_s``
seconds. ``view(window_s)`` answers with plain JSON data over the newest ``window_s``
seconds of it:

- counters become deltas between the oldest snapshot in the window and the newest one,
  divided by the time between them for a rate;
- histograms become bucket-count deltas, and percentiles of those follow Prometheus's
  ``histogram_quantile``: linear interpolation inside the bucket that holds the rank, the
  first bucket starting at 0, an answer in the +Inf bucket clamped to the highest finite
  bound, and no answer (None) without observations.

Counters and histograms are stored reset-corrected, as Prometheus's ``rate`` reads them:
when a value goes down (a logger that started over) the last value before the drop is
added to everything after it, so no delta is ever negative.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from dataclasses import dataclass

from vllmpy.metrics.prometheus import PrometheusStatLogger

# Scalar counters: the key a snapshot stores each under -> the sample name /metrics shows.
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    # declared by the logger only once an engine reports speculative decoding
    "spec_drafts": "vllm:spec_decode_num_drafts_total",
    "spec_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds_bucket",
    "itl": "vllm:inter_token_latency_seconds_bucket",
    "e2e": "vllm:e2e_request_latency_seconds_bucket",
}
FINISHED = "vllm:request_success_total"  # one series per finished_reason label
# sample name -> ("gauge" | "counter" | "histogram", the key a snapshot stores it under)
_READ = {**{name: ("gauge", key) for key, name in GAUGES.items()},
         **{name: ("counter", key) for key, name in COUNTERS.items()},
         **{name: ("histogram", key) for key, name in HISTOGRAMS.items()}}
QUANTILES = (0.5, 0.9, 0.99)
# Points per plotted line at most; a longer window merges neighbouring samples.
MAX_SERIES_POINTS = 300


@dataclass(frozen=True)
class Snapshot:
    """The logger's numbers at one moment (counters and buckets reset-corrected)."""

    t: float  # seconds since the epoch
    gauges: dict[str, float]  # GAUGES' keys
    counters: dict[str, float]  # COUNTERS' keys present in the registry, "finished:<reason>"
    buckets: dict[str, tuple[float, ...]]  # HISTOGRAMS' keys -> cumulative counts, +Inf last


def histogram_quantile(q: float, bounds: tuple[float, ...],
                       cumulative: tuple[float, ...]) -> float | None:
    """Prometheus's ``histogram_quantile(q, ...)`` over cumulative bucket counts whose
    upper bounds are ``bounds`` (the last one +Inf); None without observations."""
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next(i for i, c in enumerate(cumulative) if c >= rank)  # the +Inf one at the latest
    if b == len(bounds) - 1:  # the +Inf bucket: its lower bound is all that is known
        return bounds[-2] if len(bounds) > 1 else None
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else cumulative[b - 1]
    # rank > below, as bucket b is the first to reach it: the bucket holds observations
    return start + (bounds[b] - start) * (rank - below) / (cumulative[b] - below)


class _ResetCorrector:
    """Running totals that never go down: a drop in a raw value means its source started
    over, so the last raw value before the drop is added to all that follow."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, ...]] = {}
        self._offset: dict[str, tuple[float, ...]] = {}

    def correct(self, key: str, raw: tuple[float, ...]) -> tuple[float, ...]:
        last = self._last.get(key)
        offset = self._offset.get(key, (0.0,) * len(raw))
        if last is not None and len(last) == len(raw) and any(
                r < p for r, p in zip(raw, last)):
            offset = tuple(o + p for o, p in zip(offset, last))
            self._offset[key] = offset
        self._last[key] = raw
        return tuple(r + o for r, o in zip(raw, offset))


class MetricsHistory:
    """Snapshots of one logger's collectors over the last ``horizon_s`` seconds.

    Contract: ``sample`` is O(number of series read) and keeps snapshots in increasing
    time (one taken at or before the newest drops the newer ones: the clock went back);
    ``run`` samples every ``interval_s`` until cancelled and never raises out of a
    sampling error; ``view`` reads only, and its answer is JSON-ready.
    """

    def __init__(self, logger: PrometheusStatLogger, interval_s: float = 1.0,
                 horizon_s: float = 900.0) -> None:
        if interval_s <= 0 or horizon_s <= 0:
            raise ValueError(f"interval_s and horizon_s must be positive, got {interval_s} "
                             f"and {horizon_s}")
        self.logger = logger
        self.interval_s = interval_s
        self.horizon_s = horizon_s
        # trimmed to the horizon by time; the length bound holds when sampled too often
        self.samples: deque[Snapshot] = deque(maxlen=math.ceil(horizon_s / interval_s) + 1)
        self.bounds: dict[str, tuple[float, ...]] = {}  # HISTOGRAMS' keys -> upper bounds
        self._registry = logger.registry.restricted_registry([*_READ, FINISHED])
        self._corrector = _ResetCorrector()

    # ---- sampling -------------------------------------------------------------------

    def sample(self, now: float | None = None) -> None:
        """Read the logger's collectors and append one snapshot taken at ``now``."""
        now = time.time() if now is None else now
        gauges = dict.fromkeys(GAUGES, 0.0)
        counters: dict[str, float] = {}
        buckets: dict[str, list[tuple[float, float]]] = {}
        # The logger updates its collectors under this lock: one consistent reading.
        with self.logger._lock:
            for family in self._registry.collect():
                for s in family.samples:  # only the names asked for (see __init__)
                    if s.name == FINISHED:
                        kind, key = "counter", f"finished:{s.labels['finished_reason']}"
                    else:
                        kind, key = _READ[s.name]
                    if kind == "gauge":
                        gauges[key] = s.value
                    elif kind == "histogram":
                        buckets.setdefault(key, []).append((float(s.labels["le"]), s.value))
                    else:
                        counters[key] = self._corrector.correct(key, (s.value,))[0]
        cumulative: dict[str, tuple[float, ...]] = {}
        for key, pairs in buckets.items():
            pairs.sort()
            self.bounds[key] = tuple(le for le, _ in pairs)
            cumulative[key] = self._corrector.correct(key, tuple(c for _, c in pairs))
        while self.samples and self.samples[-1].t >= now:
            self.samples.pop()
        self.samples.append(Snapshot(now, gauges, counters, cumulative))
        while self.samples[0].t < now - self.horizon_s:
            self.samples.popleft()

    async def run(self) -> None:
        """Sample every ``interval_s`` seconds, forever; a failing sample is reported once
        on stderr and sampling goes on."""
        reported = False
        while True:
            try:
                self.sample()
            except Exception as e:  # the dashboard must never take the server down
                if not reported:
                    print(f"vllmpy: the dashboard's metrics sampling failed ({e!r}); it "
                          f"keeps trying, and reports no further failures", file=sys.stderr,
                          flush=True)
                    reported = True
            await asyncio.sleep(self.interval_s)

    # ---- the view -------------------------------------------------------------------

    def view(self, window_s: float) -> dict:
        """The dashboard's data over the newest ``window_s`` seconds (see the module
        docstring for how counters and histograms are read)."""
        if not self.samples:
            return _empty_view(self.logger.model_name, time.time())
        last = self.samples[-1]
        window = [s for s in self.samples if s.t >= last.t - window_s]
        first = window[0]
        elapsed = last.t - first.t

        def delta(key: str) -> float:
            return max(last.counters.get(key, 0.0) - first.counters.get(key, 0.0), 0.0)

        def rate(key: str) -> float | None:
            return _round(delta(key) / elapsed) if elapsed > 0 else None

        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        reasons = sorted(k for k in last.counters if k.startswith("finished:"))
        return {
            "model": self.logger.model_name,
            "now": last.t,
            "window_s": _round(elapsed),
            "gauges": {key: _round(value) for key, value in last.gauges.items()},
            "throughput": {"prompt_tokens_per_s": rate("prompt_tokens"),
                           "generation_tokens_per_s": rate("generation_tokens"),
                           "prompt_tokens": delta("prompt_tokens"),
                           "generation_tokens": delta("generation_tokens")},
            "prefix_cache": {"hit_rate": _round(hits / queries) if queries else None,
                             "queries": queries, "hits": hits},
            "preemptions": {"window": delta("preemptions"),
                            "total": last.counters.get("preemptions", 0.0)},
            "requests_finished": {k.split(":", 1)[1]: delta(k) for k in reasons},
            "latency": {key: self._percentiles(key, first, last) for key in HISTOGRAMS},
            "spec_decode": _spec_decode(last, delta),
            "series": self._series(window),
        }

    def _percentiles(self, key: str, first: Snapshot, last: Snapshot) -> dict:
        after = last.buckets.get(key)
        if after is None:
            return {"count": 0.0, **{_qname(q): None for q in QUANTILES}}
        before = first.buckets.get(key, (0.0,) * len(after))
        window = tuple(max(a - b, 0.0) for a, b in zip(after, before))
        bounds = self.bounds[key]
        return {"count": window[-1], **{_qname(q): _round(histogram_quantile(q, bounds, window))
                                        for q in QUANTILES}}

    def _series(self, window: list[Snapshot]) -> dict[str, list]:
        """One point per step of at most MAX_SERIES_POINTS steps: the step's end time, the
        gauges' highest value within it, and token rates over it."""
        out: dict[str, list] = {"t": [], "running": [], "waiting": [], "kv_cache_usage": [],
                                "generation_tokens_per_s": [], "prompt_tokens_per_s": []}
        step = max(1, math.ceil((len(window) - 1) / MAX_SERIES_POINTS))
        for end in range(len(window) - 1, 0, -step):
            start = max(end - step, 0)
            a, b = window[start], window[end]
            out["t"].append(b.t)
            for key in GAUGES:
                out[key].append(_round(max(s.gauges[key] for s in window[start + 1:end + 1])))
            for key in ("generation_tokens", "prompt_tokens"):
                grown = max(b.counters.get(key, 0.0) - a.counters.get(key, 0.0), 0.0)
                out[f"{key}_per_s"].append(_round(grown / (b.t - a.t)))
        for values in out.values():
            values.reverse()
        return out


def _spec_decode(last: Snapshot, delta) -> dict | None:
    """Acceptance over the window, or None where the logger has no spec-decode counters."""
    if "spec_draft_tokens" not in last.counters:
        return None
    drafts, draft_tokens = delta("spec_drafts"), delta("spec_draft_tokens")
    accepted = delta("spec_accepted_tokens")
    return {"acceptance_rate": _round(accepted / draft_tokens) if draft_tokens else None,
            "mean_acceptance_length": _round(1 + accepted / drafts) if drafts else None,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted}


def _empty_view(model: str, now: float) -> dict:
    """What ``view`` answers before the first sample: nothing measured yet."""
    none_q = {"count": 0.0, **{_qname(q): None for q in QUANTILES}}
    return {"model": model, "now": now, "window_s": 0.0,
            "gauges": {key: None for key in GAUGES},
            "throughput": {"prompt_tokens_per_s": None, "generation_tokens_per_s": None,
                           "prompt_tokens": 0.0, "generation_tokens": 0.0},
            "prefix_cache": {"hit_rate": None, "queries": 0.0, "hits": 0.0},
            "preemptions": {"window": 0.0, "total": 0.0},
            "requests_finished": {},
            "latency": {key: dict(none_q) for key in HISTOGRAMS},
            "spec_decode": None,
            "series": {key: [] for key in ("t", *GAUGES, "generation_tokens_per_s",
                                           "prompt_tokens_per_s")}}


def _qname(q: float) -> str:
    return f"p{round(q * 100):d}"


def _round(x: float | None) -> float | None:
    """Six significant digits: enough for a dashboard, and a short JSON body."""
    return None if x is None else float(f"{x:.6g}")
