#!/usr/bin/env python3
"""Wait until the local tritonserver has no request left, for a Kubernetes preStop hook (docker/k8s).

On SIGTERM our models end the requests still in flight with CANCELLED (docs/faults.md), so a pod must be
drained first: Kubernetes takes it out of the Service while this runs, then sends SIGTERM when it returns.
Idle = every gauge below reads 0 in two scrapes at least one metrics interval apart:
  nv_inference_pending_request_count   requests Triton holds in a model's queue (the dynamic batcher's too)
  vllm:num_requests_running / waiting  requests inside an engine
  inflight:num_requests_inflight        requests the `llm` model accepted and has not finished

    python scripts/drain.py [--settle-s 5] [--timeout-s 600]   (METRICS_PORT, default 8002)

Exit status 0 when idle, 1 at the timeout (Kubernetes then goes on with SIGTERM either way).
Standard library only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

BUSY_GAUGES = ("nv_inference_pending_request_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
               "inflight:num_requests_inflight")


def busy_count(metrics_text: str) -> float:
    """Sum of the BUSY_GAUGES samples in a Prometheus text exposition."""
    total = 0.0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in BUSY_GAUGES:
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(url: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return busy_count(resp.read().decode())
    except OSError:
        return None  # server already gone or not up: nothing to wait for


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=f"http://127.0.0.1:{os.environ.get('METRICS_PORT', '8002')}/metrics")
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="wait this long first: requests routed before the endpoint was removed still arrive")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--interval-s", type=float, default=1.5,
                        help="between scrapes; longer than the models' metrics_interval_ms (1 s)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout_s
    time.sleep(args.settle_s)
    idle_reads = 0
    while time.monotonic() < deadline:
        busy = scrape(args.url)
        if busy is None:
            print("drain: metrics endpoint unreachable; nothing to wait for", flush=True)
            return 0
        idle_reads = idle_reads + 1 if busy == 0 else 0
        if idle_reads >= 2:
            print("drain: idle", flush=True)
            return 0
        time.sleep(args.interval_s)
    print(f"drain: still busy after {args.timeout_s:.0f} s", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
