"""Per-request timings from a perf_analyzer --profile-export-file, and the figures the report compares.

Throughput is taken over the steady window, from the first request sent to the last one sent: a closed
loop keeps every client busy there, while the tail after it (clients running out of work) would
penalize whichever arm finishes its last long request alone. TTFT, inter-token latency (per request:
(last - first response) / (tokens - 1), genai-perf's definition) and end-to-end latency cover every
request.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


@dataclass
class RequestTiming:
    sent_ns: int
    response_ns: list[int]  # responses that carried tokens
    tokens: list[int]  # tokens each of those responses carried

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)


@dataclass
class CellStats:
    """One (arm, workload, concurrency) measurement."""
    num_requests: int
    num_errors: int
    output_tokens: int
    window_s: float
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def load_profile(path: Path) -> list[RequestTiming]:
    """Requests of the (single) experiment in a perf_analyzer profile export. A response's token count is
    its num_output_tokens output (requested by the workload); responses without tokens are skipped."""
    export = json.loads(Path(path).read_text())
    timings = []
    for experiment in export["experiments"]:
        for req in experiment["requests"]:
            stamps, counts = [], []
            for ts, out in zip(req.get("response_timestamps", []), req.get("response_outputs", [])):
                n = int(out.get("num_output_tokens") or 0) if isinstance(out, dict) else 0
                if n > 0:
                    stamps.append(int(ts))
                    counts.append(n)
            timings.append(RequestTiming(int(req["timestamp"]), stamps, counts))
    return timings


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(runs: list[list[RequestTiming]]) -> CellStats:
    """One cell from one or more runs of it (rounds alternating with the other arm): throughput adds up the
    runs' steady windows, latencies pool every request. A request that produced no token is an error."""
    timings = [t for run in runs for t in run]
    ok = [t for t in timings if t.response_ns]
    if not ok:
        raise ValueError(f"no request of {len(timings)} produced a token: allowed a run with at least one")
    window_tokens = window_done = window_ns = 0
    for run in runs:
        done = [t for t in run if t.response_ns]
        if not done:
            continue
        start, last_sent = min(t.sent_ns for t in run), max(t.sent_ns for t in run)
        if last_sent <= start:  # a single request (or all sent at once): the whole run is the window
            last_sent = max(t.response_ns[-1] for t in done)
        window_tokens += sum(n for t in done for ts, n in zip(t.response_ns, t.tokens) if start <= ts <= last_sent)
        window_done += sum(1 for t in done if t.response_ns[-1] <= last_sent)
        window_ns += last_sent - start
    window_s = window_ns / 1e9
    ttft = [(t.response_ns[0] - t.sent_ns) / 1e6 for t in ok]
    e2e = [(t.response_ns[-1] - t.sent_ns) / 1e6 for t in ok]
    itl = [(t.response_ns[-1] - t.response_ns[0]) / 1e6 / (t.num_tokens - 1) for t in ok if t.num_tokens > 1]
    return CellStats(
        num_requests=len(timings), num_errors=len(timings) - len(ok), output_tokens=sum(t.num_tokens for t in ok),
        window_s=window_s, tokens_per_s=window_tokens / window_s, requests_per_s=window_done / window_s,
        ttft_p50_ms=_pct(ttft, 50), ttft_p99_ms=_pct(ttft, 99), itl_p50_ms=_pct(itl, 50), itl_p99_ms=_pct(itl, 99),
        e2e_p50_ms=_pct(e2e, 50), e2e_p99_ms=_pct(e2e, 99))
