"""Replay a trace on a real tritonserver with timed arrivals over one streaming gRPC connection.

Each request is sent at its arrival time (greedy, ignore_eos, max_tokens = its output length, so lengths are
exact), every response is timestamped on arrival, and the figures are computed the way the simulator
computes them (tuner.sim.summarize): TTFT from send to first response, ITL from the gaps between responses
(a response carrying k tokens counts its gap k times, split evenly), throughput over first send to last final.
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient

from server_harness.quiescence import scrape
from server_harness.server import TritonServer
from server_harness.stream_client import make_inputs
from tuner.sim import summarize

_ERROR_ID = re.compile(r"\(request id '([^']*)'\)$|^\[request id: ([^\]]*)\]")


@dataclass
class _Record:
    sent_at: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    final_at: float | None = None
    error: str | None = None


class Replayer:
    """One gRPC stream; requests sent at their arrival times from the caller's thread."""

    def __init__(self, url: str, model: str = "llm"):
        self.model = model
        self.records: dict[str, _Record] = {}
        self.unmatched_errors: list[str] = []
        self._done = threading.Condition()
        self._num_final = 0
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result=None, error=None) -> None:
        now = time.monotonic()
        with self._done:
            if result is None:
                message = error.message() if hasattr(error, "message") else str(error)
                m = _ERROR_ID.search(message or "")
                rec = self.records.get((m.group(1) or m.group(2)) if m else None)
                if rec is None:
                    self.unmatched_errors.append(message)
                    return
                rec.error, rec.final_at = message, now
            else:
                response = result.get_response()
                rec = self.records[response.id]
                n = result.as_numpy("num_output_tokens")
                rec.times.append(now)
                rec.tokens.append(int(n.reshape(-1)[0]) if n is not None else 1)
                if response.parameters["triton_final_response"].bool_param:
                    rec.final_at = now
                else:
                    return
            self._num_final += 1
            self._done.notify_all()

    def send(self, request_id: str, prompt: str, output_tokens: int, priority: int = 0) -> None:
        values = {"max_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                  "return_num_output_tokens": True}
        if priority:
            values["priority"] = priority
        with self._done:
            self.records[request_id] = _Record(sent_at=time.monotonic())
        self.client.async_stream_infer(self.model, make_inputs(prompt, values), request_id=request_id)

    def wait(self, count: int, deadline: float) -> bool:
        with self._done:
            while self._num_final < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(min(left, 0.5))
            return True

    def close(self, cancel: bool) -> None:
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


def replay(url: str, requests: list[tuple[float, str, int, int]], drain_s: float, progress=print,
           model: str = "llm") -> dict:
    """requests: (arrival_s, prompt, output_tokens, priority). Sends each at its time, waits up to drain_s
    after the last send for the finals (the rest are cancelled), and returns the figures."""
    rp = Replayer(url, model)
    t0 = time.monotonic()
    next_report = t0 + 10
    lags = []
    try:
        for k, (arrival, prompt, out_tokens, priority) in enumerate(requests):
            delay = t0 + arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            lags.append(time.monotonic() - t0 - arrival)  # a busy client sends late: the replay's own error
            rp.send(str(k), prompt, out_tokens, priority)
            if time.monotonic() > next_report:
                progress(f"[verify] sent {k + 1}/{len(requests)} at {time.monotonic() - t0:.0f} s, "
                         f"{rp._num_final} finished")
                next_report += 10
        finished = rp.wait(len(requests), time.monotonic() + drain_s)
    finally:
        rp.close(cancel=True)
    figures = figures_of(rp, len(requests), finished)
    figures["send_lag_p99_ms"] = 1e3 * sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else 0.0
    return figures


def figures_of(rp: Replayer, num_requests: int, finished_all: bool) -> dict:
    ttft, itl, e2e = [], [], []
    out_tokens = done = errors = 0
    first_sent = min((r.sent_at for r in rp.records.values()), default=0.0)
    last_final = first_sent
    for rec in rp.records.values():
        if rec.error is not None:
            errors += 1
            continue
        out_tokens += sum(rec.tokens)
        if rec.times:
            ttft.append(rec.times[0] - rec.sent_at)
        prev = rec.times[0] if rec.times else None
        for t, k in zip(rec.times[1:], rec.tokens[1:]):
            itl.extend([(t - prev) / k] * k if k else [])
            prev = t
        if rec.final_at is not None:
            done += 1
            e2e.append(rec.final_at - rec.sent_at)
            last_final = max(last_final, rec.final_at)
    extra = {"requests": num_requests, "errors": errors, "unmatched_errors": len(rp.unmatched_errors),
             "unfinished": num_requests - done - errors, "finished_in_time": finished_all}
    return summarize(ttft, itl, e2e, [], out_tokens, done, last_final - first_sent, extra)


def server_figures(metrics_url: str, model: str = "llm") -> dict:
    """What the engine itself counted (exported every metrics_interval_ms: call a second after the run)."""
    m = scrape(metrics_url, model)
    steps = m.get("inflight:step_time_seconds_count", 0.0)
    queries = m.get("vllm:prefix_cache_queries_total", 0.0)
    return {"preemptions": m.get("vllm:num_preemptions_total", 0.0),
            "steps": steps,
            "step_mean_ms": 1e3 * m.get("inflight:step_time_seconds_sum", 0.0) / steps if steps else 0.0,
            "prefix_hit_rate": m.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0.0}


def serve_and_replay(repo: Path, config_name: str | None, threads: int | None, requests, drain_s: float,
                     log_path: Path, warmup: list[str], progress=print) -> dict:
    """Start tritonserver on `repo` with only `llm` loaded (config_name: --model-config-name), threads as
    OMP_NUM_THREADS (None: unset, as `make serve` runs), warm it up, replay, stop it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    args = ["--load-model=llm"] + ([f"--model-config-name={config_name}"] if config_name else [])
    load_before = os.getloadavg()
    with TritonServer(repo, args, model_control_mode="explicit", log_path=log_path, env=env, clear_env=True,
                      startup_timeout_s=300) as server:
        progress(f"[verify] server up ({config_name or 'default config'}, OMP_NUM_THREADS="
                 f"{threads or 'unset'}); warming up")
        replay(server.grpc_url, [(0.0, p, 4, 0) for p in warmup], drain_s=120, progress=progress)
        base = server_figures(server.metrics_url) if warmup else {}
        figures = replay(server.grpc_url, requests, drain_s, progress)
        time.sleep(1.5)  # one metrics export period, so the counters include the last steps
        after = server_figures(server.metrics_url)
    for key in ("preemptions", "steps"):
        figures[key] = after[key] - base.get(key, 0.0)
    figures["step_mean_ms"] = after["step_mean_ms"]  # includes the warm-up's few steps
    figures["prefix_hit_rate"] = after["prefix_hit_rate"]
    figures["load_average"] = [round(x, 2) for x in load_before] + [round(x, 2) for x in os.getloadavg()]
    problems = server.leftovers()
    if problems:
        figures["server_leftovers"] = problems
    return figures
