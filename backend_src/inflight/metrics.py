"""Engine metrics: counters, gauges and histograms written by the engine thread and read, as a
consistent snapshot, from any other thread (the Triton metrics exporter)."""
from __future__ import annotations

import bisect
import math
import threading
import weakref
from typing import Any, Iterable

from .sequence import Sequence

# Bucket upper bounds (seconds), as vLLM's. Inter-token latency adds 1 ms and 5 ms at the low end:
# a small model on a GPU decodes faster than vLLM's first 10 ms bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Queue time is often near zero when the server is idle, so it also gets sub-300 ms resolution.
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + REQUEST_LATENCY_BUCKETS
# Grammar compiles: a cached-size regex takes well under a millisecond, a large schema seconds.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0)

GAUGE_NAMES = ("num_requests_running", "num_requests_waiting", "num_requests_preempted", "kv_blocks_used",
               "kv_blocks_free", "kv_cache_usage", "kv_internal_waste")


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's buckets for per-request token counts)."""
    bounds, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(float(b) for b in bounds)
            bounds.append(m * scale)
        scale *= 10


N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


def token_buckets(max_tokens: int) -> tuple[float, ...]:
    """Powers of two up to and including max_tokens (the step token budget)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} is out of range: allowed an integer >= 1")
    bounds, b = [], 1
    while b < max_tokens:
        bounds.append(float(b))
        b *= 2
    bounds.append(float(max_tokens))
    return tuple(bounds)


class Histogram:
    """Prometheus-style histogram: counts[i] holds observations v with bounds[i-1] < v <= bounds[i];
    the last entry is the +Inf bucket. Not locked itself; EngineMetrics guards it."""

    def __init__(self, buckets: Iterable[float]):
        bounds = tuple(float(b) for b in buckets)
        if not bounds:
            raise ValueError("buckets=() is empty: allowed at least one finite bound")
        if any(not math.isfinite(b) for b in bounds):
            raise ValueError(f"buckets={bounds!r} hold a non-finite bound: allowed finite numbers (+Inf is implied)")
        if any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"buckets={bounds!r} are not strictly increasing: allowed b0 < b1 < ...")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Record `value` n times (n > 1: n tokens that shared one gap)."""
        # bisect_left gives the first bound >= value, i.e. Prometheus' "le" bucket.
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.count += n
        self.sum += value * n

    def cumulative_counts(self) -> list[int]:
        """Counts as Prometheus exposes them: observations <= each bound, ending with +Inf (== count)."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.bounds), "counts": list(self.counts), "count": self.count, "sum": self.sum}


class EngineMetrics:
    """Everything the engine measures. Writers are the engine thread's on_* methods; readers call snapshot().

    Every method takes one lock for the few additions it makes, computing values before taking it.

    Histograms (name: what vLLM calls it):
      time_to_first_token_seconds: vllm:time_to_first_token_seconds (arrival to first output token)
      inter_token_latency_seconds: vllm:time_per_output_token_seconds, renamed
                                   vllm:inter_token_latency_seconds in later vLLM (gap between tokens)
      e2e_request_latency_seconds: vllm:e2e_request_latency_seconds (arrival to finish)
      request_queue_time_seconds:  vllm:request_queue_time_seconds (arrival to first scheduled)
      step_time_seconds:           no vLLM equivalent (one engine step, schedule to outputs)
      tokens_per_step:             vllm:iteration_tokens_total (tokens in one forward)
      batch_size:                  no vLLM equivalent (requests in one batch the dynamic batcher formed)
      request_prompt_tokens:       vllm:request_prompt_tokens (per finished request)
      request_generation_tokens:   vllm:request_generation_tokens (per finished request)
      request_params_n:            vllm:request_params_n (samples a request asked for)
      grammar_compile_seconds:     no vLLM equivalent (one grammar compile, in its worker process)

    Speculative decoding counters (vLLM's spec_decode_* names): drafts verified (one per request and step that
    had any), draft tokens, accepted draft tokens, and accepted tokens by draft position (position i counts the
    drafts whose first i + 1 tokens were all accepted). Acceptance rate = accepted / draft tokens; mean accepted
    length = 1 + accepted / drafts (the token after the accepted drafts included).
    """

    def __init__(self, max_num_batched_tokens: int = 8192, max_batch_size: int = 256, max_model_len: int = 2048,
                 num_speculative_tokens: int = 0):
        self._lock = threading.Lock()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.requests_finished_total: dict[str, int] = {}
        self.queue_full_refusals_total = 0  # requests refused at once: max_queue_size were already waiting
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found
        self.grammar_cache_hits = 0  # requests whose grammar was compiled (or compiling) already
        self.grammar_cache_misses = 0  # requests that started a compile
        self.grammar_compile_errors = 0  # compiles the library refused (the request got INVALID_ARG)
        self.grammar_compile_timeouts = 0  # requests refused for a compile past grammar_compile_timeout_ms
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_accepted_tokens_per_pos = [0] * num_speculative_tokens
        self.histograms: dict[str, Histogram] = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(INTER_TOKEN_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(QUEUE_TIME_BUCKETS),
            "step_time_seconds": Histogram(STEP_TIME_BUCKETS),
            "tokens_per_step": Histogram(token_buckets(max_num_batched_tokens)),
            "batch_size": Histogram(token_buckets(max_batch_size)),
            "request_prompt_tokens": Histogram(one_two_five_buckets(max_model_len)),
            "request_generation_tokens": Histogram(one_two_five_buckets(max_model_len)),
            "request_params_n": Histogram(N_BUCKETS),
            "grammar_compile_seconds": Histogram(GRAMMAR_COMPILE_BUCKETS),
        }
        self.gauges: dict[str, float] = {name: 0 for name in GAUGE_NAMES}
        # Our own per-request marks, so the engine may set seq.first_*_time before or after calling us.
        # Weak keys: a request that is dropped without on_finish leaves nothing behind.
        self._scheduled: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self._last_token_at: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()

    # ---- engine side ------------------------------------------------------------------------------
    def on_scheduled(self, seq: Sequence, now: float) -> None:
        """Queue time, the first time a request is scheduled (later calls, e.g. after preemption, are no-ops)."""
        if seq in self._scheduled:
            return
        self._scheduled.add(seq)
        wait = max(0.0, now - seq.arrival_time)
        with self._lock:
            self.histograms["request_queue_time_seconds"].observe(wait)

    def on_tokens(self, seq: Sequence, num_new: int, now: float) -> None:
        """num_new output tokens of seq arrived at `now`: TTFT for a request's first, then the gap per token.

        When several tokens arrive together, each is charged an equal share of the gap since the last.
        """
        if num_new <= 0:
            return
        last = self._last_token_at.get(seq)
        self._last_token_at[seq] = now
        with self._lock:
            self.generation_tokens_total += num_new
            if last is None:
                self.histograms["time_to_first_token_seconds"].observe(max(0.0, now - seq.arrival_time))
                if num_new > 1:
                    self.histograms["inter_token_latency_seconds"].observe(0.0, num_new - 1)
            else:
                self.histograms["inter_token_latency_seconds"].observe(max(0.0, now - last) / num_new, num_new)

    def on_step_tokens(self, first_token_waits: list[float], gaps: list[float]) -> None:
        """One step's output tokens, one per request, under one lock: the engine's hot path.

        first_token_waits: arrival to first token, for requests whose first token this is; gaps: time since
        the request's previous token, for the others. (on_tokens does the same per request, keeping its own
        marks; the engine has them on its sequences already.)
        """
        with self._lock:
            self.generation_tokens_total += len(first_token_waits) + len(gaps)
            ttft = self.histograms["time_to_first_token_seconds"]
            for wait in first_token_waits:
                ttft.observe(max(0.0, wait))
            itl = self.histograms["inter_token_latency_seconds"]
            for gap in gaps:
                itl.observe(max(0.0, gap))

    def on_finish(self, seq: Sequence, now: float) -> None:
        """End to end latency and the finished count under seq.finish_reason.value ('unknown' if unset)."""
        reason = seq.finish_reason.value if seq.finish_reason is not None else "unknown"
        self._last_token_at.pop(seq, None)
        self._scheduled.discard(seq)
        with self._lock:
            self.histograms["e2e_request_latency_seconds"].observe(max(0.0, now - seq.arrival_time))
            self.histograms["request_prompt_tokens"].observe(seq.num_prompt_tokens)
            self.histograms["request_generation_tokens"].observe(seq.num_output_tokens)
            self.requests_finished_total[reason] = self.requests_finished_total.get(reason, 0) + 1

    def on_request(self, n: int) -> None:
        """A request arrived asking for n samples."""
        with self._lock:
            self.histograms["request_params_n"].observe(n)

    def on_prompt_tokens(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens_total += n

    def on_queue_full(self) -> None:
        with self._lock:
            self.queue_full_refusals_total += 1

    def on_preemption(self) -> None:
        with self._lock:
            self.num_preemptions_total += 1

    def on_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        if not 0 <= num_hit_tokens <= num_query_tokens:
            raise ValueError(f"num_hit_tokens={num_hit_tokens} is out of range: allowed [0, "
                             f"num_query_tokens={num_query_tokens}]")
        with self._lock:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    def on_grammar_request(self, cache_hit: bool) -> None:
        with self._lock:
            if cache_hit:
                self.grammar_cache_hits += 1
            else:
                self.grammar_cache_misses += 1

    def on_grammar_compile(self, seconds: float, ok: bool) -> None:
        """From a compile lane's thread (the lock makes that safe)."""
        with self._lock:
            self.histograms["grammar_compile_seconds"].observe(seconds)
            self.grammar_compile_errors += 0 if ok else 1

    def on_grammar_timeout(self) -> None:
        with self._lock:
            self.grammar_compile_timeouts += 1
    def on_spec_decode(self, num_drafts: int, num_draft_tokens: int, num_accepted: int,
                       accepted_per_pos: list[int]) -> None:
        """One step's verification: drafts (requests with drafts), their tokens, those accepted, and per draft
        position how many drafts had it accepted (a list no longer than num_speculative_tokens)."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"num_accepted={num_accepted} is out of range: allowed [0, "
                             f"num_draft_tokens={num_draft_tokens}]")
        with self._lock:
            self.spec_decode_num_drafts += num_drafts
            self.spec_decode_num_draft_tokens += num_draft_tokens
            self.spec_decode_num_accepted_tokens += num_accepted
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            for pos, n in enumerate(accepted_per_pos):
                per_pos[pos] += n

    def on_step(self, duration_s: float, num_tokens: int) -> None:
        with self._lock:
            self.histograms["step_time_seconds"].observe(duration_s)
            self.histograms["tokens_per_step"].observe(num_tokens)

    def on_batch(self, size: int) -> None:
        """The dynamic-batcher arm: execute() received a batch of `size` requests."""
        with self._lock:
            self.histograms["batch_size"].observe(size)

    def set_gauges(self, **values: float) -> None:
        unknown = sorted(set(values) - set(GAUGE_NAMES))
        if unknown:
            raise ValueError(f"unknown gauge(s) {', '.join(unknown)}: allowed {', '.join(GAUGE_NAMES)}")
        with self._lock:
            self.gauges.update(values)

    # ---- reader side ------------------------------------------------------------------------------
    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens since start; 0.0 before any lookup."""
        with self._lock:
            return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of every metric, consistent as of one instant; safe from any thread.

        {"counters": {name: int, "requests_finished_total": {reason: int}},
         "gauges": {name: number}, "histograms": {name: Histogram.to_dict()}, "prefix_hit_rate": float}
        """
        with self._lock:
            counters: dict[str, Any] = {
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "num_preemptions_total": self.num_preemptions_total,
                "requests_finished_total": dict(self.requests_finished_total),
                "queue_full_refusals_total": self.queue_full_refusals_total,
                "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "grammar_cache_hits": self.grammar_cache_hits,
                "grammar_cache_misses": self.grammar_cache_misses,
                "grammar_compile_errors": self.grammar_compile_errors,
                "grammar_compile_timeouts": self.grammar_compile_timeouts,
                "spec_decode_num_drafts": self.spec_decode_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_decode_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.spec_decode_num_accepted_tokens_per_pos),
            }
            gauges = dict(self.gauges)
            histograms = {name: h.to_dict() for name, h in self.histograms.items()}
        queries = counters["prefix_cache_queries"]
        return {"counters": counters, "gauges": gauges, "histograms": histograms,
                "prefix_hit_rate": counters["prefix_cache_hits"] / queries if queries else 0.0}
