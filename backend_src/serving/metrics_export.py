"""Periodic export of engine metrics (EngineMetrics.snapshot) to Prometheus-style metric families,
from ONE thread: Triton's python backend aborts when metrics are updated from several threads at once.

The sink (pb_utils.MetricFamily in the Triton model, a fake in tests) offers counters (increment),
gauges (set) and histograms (observe). Histograms are replayed from bucket-count deltas: each new
observation is observed at a value inside its bucket, chosen so the exported _sum matches too.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Any: ...  # .increment(v)

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Any: ...  # .set(v)

    def histogram(self, name: str, description: str, labels: Mapping[str, str],
                  buckets: list[float]) -> Any: ...  # .observe(v)


@dataclass(frozen=True)
class Export:
    name: str  # exported name
    source: str  # key in the snapshot section
    description: str


HISTOGRAMS = (
    Export("vllm:time_to_first_token_seconds", "time_to_first_token_seconds",
           "Histogram of time to first token in seconds (arrival to first output token)."),
    Export("vllm:time_per_output_token_seconds", "inter_token_latency_seconds",
           "Histogram of time per output token in seconds (gap between consecutive tokens)."),
    Export("vllm:e2e_request_latency_seconds", "e2e_request_latency_seconds",
           "Histogram of end to end request latency in seconds."),
    Export("vllm:request_queue_time_seconds", "request_queue_time_seconds",
           "Histogram of time spent waiting before first scheduled, in seconds."),
    Export("vllm:iteration_tokens_total", "tokens_per_step", "Histogram of tokens per engine step."),
    Export("inflight:step_time_seconds", "step_time_seconds", "Histogram of engine step duration in seconds."),
    Export("vllm:request_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens processed."),
    Export("vllm:request_generation_tokens", "request_generation_tokens", "Number of generation tokens processed."),
    Export("vllm:request_params_n", "request_params_n", "Histogram of the n request parameter."),
    Export("inflight:batch_size", "batch_size",
           "Histogram of the batch sizes the dynamic batcher hands execute() (dynamic-batcher arm only)."),
    Export("inflight:grammar_compile_seconds", "grammar_compile_seconds",
           "Histogram of structured-output grammar compile time in seconds (in the compile worker)."),
)
COUNTERS = (
    Export("vllm:prompt_tokens_total", "prompt_tokens_total", "Number of prefill tokens processed."),
    Export("vllm:generation_tokens_total", "generation_tokens_total", "Number of generation tokens processed."),
    Export("vllm:num_preemptions_total", "num_preemptions_total", "Cumulative number of preemptions."),
    Export("vllm:prefix_cache_queries_total", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    Export("vllm:prefix_cache_hits_total", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    Export("inflight:queue_full_refusals_total", "queue_full_refusals_total",
           "Requests refused at once (UNAVAILABLE) because max_queue_size requests were already waiting."),
    Export("inflight:grammar_cache_hits_total", "grammar_cache_hits",
           "Structured-output requests whose grammar was in the compiled-grammar cache (no compile)."),
    Export("inflight:grammar_cache_misses_total", "grammar_cache_misses",
           "Structured-output requests that started a grammar compile."),
    Export("inflight:grammar_compile_errors_total", "grammar_compile_errors",
           "Grammar compiles the library refused (each such request got INVALID_ARG)."),
    Export("inflight:grammar_compile_timeouts_total", "grammar_compile_timeouts",
           "Requests refused because their grammar compile ran past grammar_compile_timeout_ms."),
    Export("vllm:spec_decode_num_drafts_total", "spec_decode_num_drafts",
           "Speculative decoding: drafts verified (one per request and step that had draft tokens)."),
    Export("vllm:spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens",
           "Speculative decoding: draft tokens verified."),
    Export("vllm:spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens",
           "Speculative decoding: draft tokens accepted (acceptance rate = this / draft tokens)."),
)
GAUGES = (
    Export("vllm:num_requests_running", "num_requests_running", "Number of requests in the running batch."),
    Export("vllm:num_requests_waiting", "num_requests_waiting", "Number of requests waiting to be scheduled."),
    Export("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV cache usage as a fraction (1 = full)."),
    Export("vllm:gpu_cache_usage_perc", "kv_cache_usage", "KV cache usage as a fraction (vLLM v0 name)."),
    Export("inflight:kv_blocks_used", "kv_blocks_used", "KV cache blocks in use."),
    Export("inflight:kv_blocks_free", "kv_blocks_free", "KV cache blocks free (cached prefix blocks count as free)."),
    Export("inflight:num_requests_preempted", "num_requests_preempted", "Preempted requests waiting to be recomputed."),
    Export("inflight:kv_internal_waste", "kv_internal_waste", "Fraction of allocated KV slots not holding tokens."),
)
# Added by the Triton glue to the snapshot (not an engine gauge): requests accepted by the frontend that
# have not had their final response yet. 0 when idle; anything else is a request that would hang.
FRONTEND_GAUGES = (
    Export("inflight:num_requests_inflight", "num_requests_inflight",
           "Requests accepted and not yet given their final response."),
)
PREFIX_HIT_RATE = Export("vllm:gpu_prefix_cache_hit_rate", "prefix_hit_rate",
                         "Prefix cache hit rate (hit tokens / looked-up tokens) since start.")
REQUEST_SUCCESS = Export("vllm:request_success_total", "requests_finished_total",
                         "Count of finished requests, by finish reason.")
SPEC_ACCEPTED_PER_POS = Export("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                               "spec_decode_num_accepted_tokens_per_pos",
                               "Speculative decoding: drafts whose token at this position (and all before it) was "
                               "accepted; / drafts = the acceptance rate per position.")


def replay_values(bounds: list[float], new_counts: list[int], new_sum: float) -> list[float]:
    """Values to observe so a histogram with `bounds` gains exactly `new_counts` per bucket (last: +Inf)
    and, as closely as the buckets allow, `new_sum` in its sum."""
    finite = [(i, c) for i, c in enumerate(new_counts[:-1]) if c > 0]
    num_inf = new_counts[-1]

    def low(i: int) -> float:
        return bounds[i - 1] if i > 0 else min(0.0, bounds[0])

    values: list[float] = []
    if num_inf == 0:
        high_total = sum(c * bounds[i] for i, c in finite)
        slack = sum(c * (bounds[i] - low(i)) for i, c in finite)
        f = (high_total - new_sum) / slack if slack > 0 else 0.0
        f = min(max(f, 0.0), 1.0 - 1e-9)  # stay above a bucket's lower bound (bounds are inclusive uppers)
        for i, c in finite:
            values += [bounds[i] - (bounds[i] - low(i)) * f] * c
        return values
    for i, c in finite:
        lo = low(i)
        values += [lo + (bounds[i] - lo) * 1e-6 if i > 0 else lo] * c
    rest = (new_sum - sum(values)) / num_inf
    floor = bounds[-1] + max(abs(bounds[-1]) * 1e-9, 1e-12)
    values += [max(rest, floor)] * num_inf
    return values


class MetricsExporter:
    """Reads snapshot() every period_s and pushes the differences since the last export. All sink calls,
    including creating metric families, happen in the thread that calls export_once (one thread)."""

    def __init__(self, snapshot: Callable[[], dict], sink: MetricSink, labels: Mapping[str, str],
                 period_s: float = 1.0):
        self._snapshot = snapshot
        self._sink = sink
        self._labels = dict(labels)
        self.period_s = period_s
        self._metrics: dict[str, Any] = {}
        self._exported: dict[str, Any] = {}  # per metric: the cumulative value(s) pushed so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="inflight-metrics", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                self.export_once()
            except Exception:  # noqa: BLE001 - a failed export must not end metrics for good
                log.exception("metrics export failed")
            if self._stop.wait(self.period_s):
                return

    def _metric(self, key: str, make: Callable[[], Any]) -> Any:
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._metrics[key] = make()
        return metric

    def export_once(self) -> None:
        snap = self._snapshot()
        counters, gauges, hists = snap["counters"], snap["gauges"], snap["histograms"]
        for e in COUNTERS:
            metric = self._metric(e.name, lambda e=e: self._sink.counter(e.name, e.description, self._labels))
            self._increment(e.name, metric, counters[e.source])
        for reason, total in sorted(counters[REQUEST_SUCCESS.source].items()):
            key = f"{REQUEST_SUCCESS.name}/{reason}"
            labels = {**self._labels, "finished_reason": reason}
            metric = self._metric(key, lambda labels=labels: self._sink.counter(
                REQUEST_SUCCESS.name, REQUEST_SUCCESS.description, labels))
            self._increment(key, metric, total)
        for position, total in enumerate(counters[SPEC_ACCEPTED_PER_POS.source]):
            key = f"{SPEC_ACCEPTED_PER_POS.name}/{position}"
            labels = {**self._labels, "position": str(position)}
            metric = self._metric(key, lambda labels=labels: self._sink.counter(
                SPEC_ACCEPTED_PER_POS.name, SPEC_ACCEPTED_PER_POS.description, labels))
            self._increment(key, metric, total)
        for e in GAUGES + tuple(f for f in FRONTEND_GAUGES if f.source in gauges):
            self._metric(e.name, lambda e=e: self._sink.gauge(e.name, e.description, self._labels)).set(
                float(gauges[e.source]))
        self._metric(PREFIX_HIT_RATE.name, lambda: self._sink.gauge(
            PREFIX_HIT_RATE.name, PREFIX_HIT_RATE.description, self._labels)).set(float(snap["prefix_hit_rate"]))
        for e in HISTOGRAMS:
            h = hists[e.source]
            metric = self._metric(e.name, lambda e=e, h=h: self._sink.histogram(
                e.name, e.description, self._labels, list(h["buckets"])))
            prev_counts, prev_sum = self._exported.get(e.name, ([0] * len(h["counts"]), 0.0))
            new_counts = [c - p for c, p in zip(h["counts"], prev_counts)]
            if any(new_counts):
                # Remember first: a failure half-way must not make the next export replay these again.
                self._exported[e.name] = (list(h["counts"]), h["sum"])
                for value in replay_values(h["buckets"], new_counts, h["sum"] - prev_sum):
                    metric.observe(value)

    def _increment(self, key: str, metric: Any, total: float) -> None:
        delta = total - self._exported.get(key, 0)
        if delta > 0:
            self._exported[key] = total
            metric.increment(delta)
