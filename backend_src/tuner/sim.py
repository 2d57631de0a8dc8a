"""Replay a trace through the project's own Scheduler and BlockManager in virtual time: no model forward.

The loop is the engine's step (backend_src/inflight/engine.py) with the forward replaced by the cost model:
requests that arrived by the start of a step join the queue (the engine loop drains its inbox between steps),
the real scheduler decides, the clock advances by the modelled step time, advance() registers full blocks,
and every row whose chunk reached its newest token samples one (dummy) token at the step's end. A request
ends at its output length, as with ignore_eos. Requests the engine would refuse are refused here too.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from inflight.config import EngineConfig
from inflight.scheduler import Scheduler
from inflight.sequence import SamplingParams, Sequence, SequenceStatus

# Output token ids of simulated requests: far above any vocabulary, and different per request, so outputs
# never make false prefix-cache hits between requests (real greedy outputs of different prompts rarely match).
_DUMMY_BASE = 1 << 40


@dataclass
class SimRequest:
    """One trace request, tokenized once per trace (configs share it)."""
    arrival_s: float
    prompt_ids: list[int]
    output_tokens: int
    priority: int = 0


class _SimSequence(Sequence):
    """A Sequence with what the simulator tracks (the engine keeps the same times on its own Sequences)."""

    def __init__(self, index: int, req: SimRequest, params: SamplingParams, arrival_s: float):
        super().__init__(str(index), req.prompt_ids, params, req.output_tokens, req.priority, arrival_s)
        self.dummy_base = _DUMMY_BASE + index * (1 << 20)
        self.is_late = False


@dataclass
class StepRecord:
    """What the scheduler decided in one step (for comparing with the real engine)."""
    start_s: float
    scheduled: list[tuple[str, int]]
    preempted: list[str]


@dataclass
class SimResult:
    figures: dict[str, float]
    steps: list[StepRecord] = field(default_factory=list)
    stopped_early: str = ""  # why the run was cut short (an SLA that can no longer hold), or ""


def kv_blocks(options: dict, kv_bytes_per_token: int) -> int:
    """The pool the engine would allocate: num_kv_blocks if set, else kv_cache_memory_bytes (CPU rule)."""
    if int(options.get("num_kv_blocks", 0)) > 0:
        return int(options["num_kv_blocks"])
    block_bytes = kv_bytes_per_token * int(options.get("block_size", 16))
    return int(options.get("kv_cache_memory_bytes", 512 * 1024 * 1024)) // block_bytes


def engine_config(options: dict) -> EngineConfig:
    """EngineConfig from engine options; `threads` (not an engine option yet) and serving options are dropped."""
    names = set(EngineConfig.__dataclass_fields__)
    return EngineConfig.from_options(**{k: v for k, v in options.items() if k in names})


def percentiles(values, qs=(50, 90, 99)) -> dict[str, float]:
    if len(values) == 0:
        return {f"p{q}": math.nan for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q}": float(v) for q, v in zip(qs, np.percentile(arr, qs))}


def summarize(ttft, itl, e2e, queue, out_tokens: int, num_done: int, span_s: float, extra: dict) -> dict:
    """The figures every report uses (times in ms), from per-request lists (seconds); shared with verify."""
    figures = {"output_tok_s": out_tokens / span_s if span_s > 0 else 0.0,
               "req_s": num_done / span_s if span_s > 0 else 0.0,
               "requests_done": num_done, "output_tokens": out_tokens, "span_s": span_s}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e), ("queue", queue)):
        for k, v in percentiles(values).items():
            figures[f"{name}_{k}_ms"] = 1e3 * v
        figures[f"{name}_mean_ms"] = 1e3 * float(np.mean(values)) if len(values) else math.nan
    figures.update(extra)
    return figures


def simulate(requests: list[SimRequest], options: dict, step_cost: Callable, kv_bytes_per_token: int,
             rate_scale: float = 1.0, record_steps: bool = False, sla: dict | None = None,
             max_steps: int = 10_000_000, warm: list[SimRequest] | None = None) -> SimResult:
    """Run the trace (arrivals divided by rate_scale) to completion under one config.

    sla ({"ttft_p99_ms", "itl_p99_ms"}) lets a hopeless run stop early: once more than 1% of the trace's
    requests have waited longer than the TTFT limit (or more than 1% of its token gaps exceed the ITL limit),
    its p99 can no longer meet it, and the rest would only cost time. Its figures are then partial.

    warm: requests served first, all at once and to the end, before the trace starts (as verify warms the
    server up): they leave their blocks in the prefix cache and count in no figure.
    """
    wall = time.perf_counter()
    cfg = engine_config(options)
    num_blocks = kv_blocks(options, kv_bytes_per_token)
    sched = Scheduler(cfg, num_blocks)
    bm = sched.bm
    n = len(requests)
    arrivals = [r.arrival_s / rate_scale for r in requests]
    ttft_limit = sla["ttft_p99_ms"] / 1e3 if sla else math.inf
    itl_limit = sla["itl_p99_ms"] / 1e3 if sla else math.inf
    allowed_late = math.floor(0.01 * n)  # p99 holds while at most 1% of values exceed the limit
    allowed_slow_gaps = math.floor(0.01 * sum(max(r.output_tokens - 1, 0) for r in requests))
    num_late = num_slow_gaps = 0
    stopped = ""

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    if warm:
        _warm_up(sched, warm, params, n)
    hits0, queries0 = bm.prefix_hits, bm.prefix_queries
    ttft, itl, e2e, queue = [], [], [], []
    steps: list[StepRecord] = []
    rejected = queue_full = out_tokens = done = preempted_total = num_steps = 0
    kv_used_time = busy_time = 0.0
    peak_blocks = 0
    now = last_finish = 0.0
    i = 0
    while i < n or sched.num_unfinished:
        if not sched.num_unfinished and arrivals[i] > now:
            now = arrivals[i]  # idle: jump to the next arrival
        while i < n and arrivals[i] <= now:
            req = requests[i]
            total = len(req.prompt_ids) + req.output_tokens
            if total > cfg.max_model_len or bm.blocks_needed(total) > num_blocks:
                rejected += 1  # make_sequence refuses these at arrival
            elif len(sched.waiting) >= cfg.max_queue_size:
                queue_full += 1  # EngineLoop.add_request: UNAVAILABLE
            else:
                sched.add(_SimSequence(i, req, params, arrivals[i]))
            i += 1
        if not sched.num_unfinished:
            continue
        out = sched.schedule()
        preempted_total += len(out.preempted)
        if record_steps:
            steps.append(StepRecord(now, [(s.request_id, k) for s, k in out.scheduled],
                                    [s.request_id for s in out.preempted]))
        if out.is_empty:
            # Nothing fits (a pool smaller than one waiting request's needs with nothing running to free):
            # the engine would spin the same way. Wait for the next arrival, or give up.
            if i < n:
                now = max(now, arrivals[i])
                continue
            stopped = f"stuck: {len(sched.waiting)} waiting requests never fit the pool of {num_blocks} blocks"
            break
        num_steps += 1
        if num_steps > max_steps:
            stopped = f"over {max_steps} steps"
            break
        dt = step_cost(out.scheduled)
        for seq, _ in out.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        now += dt
        sched.advance(out.scheduled)
        used = bm.num_used_blocks
        kv_used_time += used * dt
        busy_time += dt
        peak_blocks = max(peak_blocks, used)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens != len(seq.token_ids):
                continue  # a prefill chunk that does not reach the prompt's end samples nothing
            seq.append_token(seq.dummy_base + seq.num_output_tokens)
            out_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
                ttft.append(now - seq.arrival_time)
            else:
                gap = now - seq.last_token_time
                itl.append(gap)
                if gap > itl_limit:
                    num_slow_gaps += 1
            seq.last_token_time = now
            if seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= cfg.max_model_len:
                sched.remove(seq)
                seq.status = SequenceStatus.FINISHED
                e2e.append(now - seq.arrival_time)
                queue.append(seq.first_scheduled_time - seq.arrival_time)
                done += 1
                last_finish = now
        if sla:
            for seq in sched.waiting + sched.running:  # no first token yet, past the limit: late whatever follows
                if seq.first_token_time is None and not seq.is_late and now - seq.arrival_time > ttft_limit:
                    seq.is_late = True
                    num_late += 1
            if num_late + rejected + queue_full > allowed_late:
                stopped = f"ttft: over 1% of requests waited > {sla['ttft_p99_ms']:.0f} ms (or were refused)"
                break
            if num_slow_gaps > allowed_slow_gaps:
                stopped = f"itl: over 1% of token gaps > {sla['itl_p99_ms']:.0f} ms"
                break
    span = max(last_finish, now) - (arrivals[0] if n else 0.0)
    extra = {
        "requests": n, "rejected": rejected, "queue_full": queue_full, "preemptions": preempted_total,
        "steps": num_steps, "kv_blocks": num_blocks, "kv_peak_use": peak_blocks / num_blocks,
        "kv_mean_use": kv_used_time / busy_time / num_blocks if busy_time else 0.0,
        "busy_frac": busy_time / span if span > 0 else 0.0,
        "step_mean_ms": 1e3 * busy_time / num_steps if num_steps else 0.0,
        "prefix_hit_rate": (bm.prefix_hits - hits0) / (bm.prefix_queries - queries0)
        if bm.prefix_queries > queries0 else 0.0,
        "prefill_tokens_saved": bm.prefix_hits - hits0, "sim_wall_s": time.perf_counter() - wall,
    }
    return SimResult(summarize(ttft, itl, e2e, queue, out_tokens, done, span, extra), steps, stopped)


def _warm_up(sched: Scheduler, warm: list[SimRequest], params: SamplingParams, first_index: int) -> None:
    """Serve `warm` to the end with the real scheduler (no clock): what stays behind is the prefix cache."""
    for k, req in enumerate(warm):
        sched.add(_SimSequence(first_index + k, req, params, 0.0))
    while sched.num_unfinished:
        out = sched.schedule()
        if out.is_empty:
            raise ValueError("a warm-up request never fits the KV pool")
        sched.advance(out.scheduled)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens != len(seq.token_ids):
                continue
            seq.append_token(seq.dummy_base + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= sched.config.max_model_len:
                sched.remove(seq)
                seq.status = SequenceStatus.FINISHED


def prepare(trace, tokenizer) -> list[SimRequest]:
    """Tokenize a trace the way the engine does (tokenizer.encode of the prompt text)."""
    from tuner.trace import prompt_text

    texts = [prompt_text(r, tokenizer) for r in trace]
    ids = tokenizer(texts)["input_ids"] if texts else []
    return [SimRequest(r.arrival_s, list(p), r.output_tokens, r.priority) for r, p in zip(trace, ids)]


def meets(figures: dict, sla: dict) -> bool:
    """The SLA holds: p99 TTFT and p99 ITL within limits and nobody refused or left unfinished."""
    return (figures["requests_done"] == figures["requests"]
            and figures["ttft_p99_ms"] <= sla["ttft_p99_ms"] and figures["itl_p99_ms"] <= sla["itl_p99_ms"])
