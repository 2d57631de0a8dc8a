"""Soak: minutes of mixed traffic (streams, non-streams, HTTP, client cancels, stop requests, dropped HTTP
streams, bad requests) against the `llm` model, sampling the stub's memory and the KV pool as it goes.

    .venv/bin/python -m perf.soak --minutes 30 --concurrency 4 --name smol-30m     # starts its own server
    .venv/bin/python -m perf.soak --seconds 40 --tiny --name quick                  # tiny-llama (the test suite)
    .venv/bin/python -m perf.soak --minutes 10 --grpc-url localhost:8001 --http-url http://localhost:8000 \\
        --metrics-url http://localhost:8002/metrics --stub-pid 1234                  # a running server

Writes perf/results/soak-<name>/: report.md, samples.csv (one row per sample), requests.csv (one row per
request), summary.json, rss.png (if matplotlib is there). Exit status 1 when any request did not get
exactly one final, a block leaked, the server-side request count disagrees, or the model is not quiescent.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from server_harness.quiescence import quiescence_problems, scrape
from server_harness.repository import make_model_repository
from server_harness.server import STUB_ARG_PARENT, TritonServer, python_stubs
from perf.soak.report import Sample, summarize, write_outputs
from perf.soak.traffic import ENGINE_BOUND, Endpoints, Traffic, finals_check

ROOT = Path(__file__).resolve().parents[2]

MODEL = "llm"
FINISHED = "vllm:request_success_total"


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def find_stub(server_pid: int | None, model: str) -> int | None:
    for pid, argv in python_stubs():
        if f"/{model}/1/model.py" in argv[1] and (server_pid is None or argv[STUB_ARG_PARENT] == str(server_pid)):
            return pid
    return None


def finished_total(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(FINISHED + "{"))


def sample(ep: Endpoints, t0: float, stub_pid: int | None, server_pid: int | None, traffic: Traffic) -> Sample:
    m = scrape(ep.metrics_url, ep.model)
    return Sample(
        t_s=round(time.monotonic() - t0, 1), stub_rss_mb=rss_mb(stub_pid), server_rss_mb=rss_mb(server_pid),
        kv_used=m.get("inflight:kv_blocks_used"), kv_free=m.get("inflight:kv_blocks_free"),
        running=m.get("vllm:num_requests_running"), waiting=m.get("vllm:num_requests_waiting"),
        inflight=m.get("inflight:num_requests_inflight"), finished=finished_total(m),
        preemptions=m.get("vllm:num_preemptions_total"), requests_sent=sum(traffic.counts().values()))


def wait_quiescent(ep: Endpoints, num_blocks: int, timeout_s: float, settle_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    good_since = None
    while True:
        problems = quiescence_problems(ep, ep.model, num_blocks)
        now = time.monotonic()
        good_since = None if problems else (good_since or now)
        if good_since is not None and now - good_since >= settle_s:
            return []
        if now > deadline:
            return problems or ["flapping"]
        time.sleep(0.1)


def start_server(args, work: Path) -> TritonServer:
    model_dir = ROOT / "models" / ("tiny-llama" if args.tiny else "SmolLM2-135M-Instruct")
    repo = make_model_repository(ROOT / "model_repository", work / "repo", {MODEL: {
        "model": model_dir, "num_kv_blocks": args.num_kv_blocks, "max_model_len": 1024,
        "metrics_interval_ms": int(args.metrics_interval_s * 1000), "default_max_tokens": 64}})
    server = TritonServer(repo, log_path=work / "server.log")
    print(f"==> starting tritonserver ({model_dir.name}); log {server.log_path}", flush=True)
    return server.start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float)
    length.add_argument("--seconds", type=float)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="upper bound of the random max_tokens")
    p.add_argument("--name", default=None)
    p.add_argument("--results-dir", type=Path, default=ROOT / "perf" / "results")
    p.add_argument("--tiny", action="store_true", help="tiny-llama instead of SmolLM2-135M-Instruct")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--sample-s", type=float, default=None, help="seconds between samples (default: duration/60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpc-url", help="use a running server (host:port) instead of starting one")
    p.add_argument("--http-url")
    p.add_argument("--metrics-url")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--stub-pid", type=int, help="the model's python-backend stub, for its RSS (--grpc-url mode)")
    p.add_argument("--metrics-interval-s", type=float, default=1.0)
    args = p.parse_args(argv)
    duration = args.seconds if args.seconds is not None else 60 * (args.minutes or 1)
    name = args.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.results_dir / f"soak-{name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    every = args.sample_s or max(2.0, duration / 60)

    server = None
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        if args.grpc_url:
            ep = Endpoints(args.model, args.grpc_url, args.http_url.rstrip("/"), args.metrics_url)
            stub_pid, server_pid = args.stub_pid or find_stub(None, args.model), None
            num_blocks = int(sum(scrape(ep.metrics_url, ep.model).get(k, 0) for k in
                                 ("inflight:kv_blocks_used", "inflight:kv_blocks_free")))
        else:
            server = start_server(args, Path(tmp))
            ep = Endpoints(MODEL, server.grpc_url, server.http_base, server.metrics_url)
            stub_pid, server_pid, num_blocks = find_stub(server.pid, MODEL), server.pid, args.num_kv_blocks
        try:
            result = soak(args, ep, duration, every, stub_pid, server_pid, num_blocks)
        finally:
            if server is not None:
                server.stop()
                result_leftovers = server.leftovers()
            else:
                result_leftovers = []
        result["summary"]["leftovers"] = result_leftovers
        config = {"duration_s": duration, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                  "model": ("tiny-llama" if args.tiny else
                            "SmolLM2-135M-Instruct" if not args.grpc_url else args.model),
                  "num_kv_blocks": num_blocks, "seed": args.seed, "server": args.grpc_url or "started by perf.soak",
                  "sample_every_s": every, "started": result["started"]}
        write_outputs(out_dir, config, result["summary"], result["samples"], result["outcomes"])
    s = result["summary"]
    print(json.dumps({k: s[k] for k in ("requests", "missing_finals", "duplicate_finals", "leaked_blocks",
                                        "server_count_mismatch", "failed_outcomes", "stub_rss_growth_mb")}))
    print(f"==> report: {out_dir / 'report.md'}")
    return 0 if s["passed"] and not s["leftovers"] else 1


def soak(args, ep: Endpoints, duration: float, every: float, stub_pid, server_pid, num_blocks: int) -> dict:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    traffic = Traffic(ep, args.concurrency, args.max_tokens, args.seed)
    before = scrape(ep.metrics_url, ep.model)
    t0 = time.monotonic()
    samples = [sample(ep, t0, stub_pid, server_pid, traffic)]
    runner = threading.Thread(target=traffic.run, args=(duration,), daemon=True)
    runner.start()
    while runner.is_alive():
        runner.join(every)
        samples.append(sample(ep, t0, stub_pid, server_pid, traffic))
        last = samples[-1]
        print(f"  t={last.t_s:>6.0f}s sent={last.requests_sent} stub_rss={last.stub_rss_mb or 0:.0f}MB "
              f"kv_used={last.kv_used} inflight={last.inflight}", flush=True)
    problems = wait_quiescent(ep, num_blocks, timeout_s=60, settle_s=3 * args.metrics_interval_s)
    samples.append(sample(ep, t0, stub_pid, server_pid, traffic))
    after = scrape(ep.metrics_url, ep.model)
    missing, duplicate, examples = finals_check(traffic.clients)
    for c in traffic.clients:
        c.close()
    engine_bound = sum(n for a, n in traffic.counts().items() if a in ENGINE_BOUND)
    server_finished = finished_total(after) - finished_total(before)
    summary = summarize(traffic.outcomes, samples, missing, duplicate, examples, problems,
                        engine_bound=engine_bound, server_finished=server_finished, num_blocks=num_blocks)
    return {"started": started, "summary": summary, "samples": samples, "outcomes": traffic.outcomes}


if __name__ == "__main__":
    sys.exit(main())
