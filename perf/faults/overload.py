"""Overload: arrivals at a multiple of what one engine instance can serve, for minutes, then the way back.

    .venv/bin/python -m perf.faults.overload                              # SmolLM2, 5x for 5 minutes
    .venv/bin/python -m perf.faults.overload --tiny --burst-s 30 --name quick

1. capacity: a closed loop of --capacity-clients streams for --capacity-s measures the requests/s the arm
   completes (one fixed request shape: a short prompt, --max-tokens tokens, ignore_eos);
2. baseline: one probe request every 2 s on the idle server, its time to first token;
3. burst: Poisson arrivals at --factor x capacity for --burst-s; every request must get exactly one final:
   data, or the queue limit's UNAVAILABLE refusal within --admission-budget-s of being sent (p99); the model
   stub's and tritonserver's RSS are sampled (bounded: no more than --rss-budget-pct above the baseline);
4. recovery: a probe every second after the burst; back to normal when probes' TTFT stays within
   max(2 x baseline p99, baseline p99 + 0.25 s) from then on; must be within --recovery-budget-s.
Writes perf/results/faults-overload-<name>/ (report.md, summary.json, timeline.csv); exit 1 on a broken target.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from server_harness.host import cpu_model_name, rss_mb
from server_harness.quiescence import quiescence_problems, scrape
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient
from server_harness.stub_watch import server_stubs

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("overload")
PROMPTS = ["Why is the sky blue?", "Name three rivers.", "What is a compiler?", "Say something kind."]


@dataclass
class Shape:
    max_tokens: int

    def values(self) -> dict:
        return {"max_tokens": self.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0.0}


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def capacity(server: TritonServer, shape: Shape, clients: int, seconds: float) -> float:
    """Requests/s completed by a closed loop of `clients` streams."""
    done, lock = [0], threading.Lock()
    deadline = time.monotonic() + seconds

    def loop(k: int) -> None:
        c = StreamClient(server.grpc_url)
        n = 0
        try:
            while time.monotonic() < deadline:
                rid = f"cap{k}-{n}"
                n += 1
                c.send("llm", rid, PROMPTS[n % len(PROMPTS)], shape.values())
                if c.wait_finals(300, ids=[rid]) and not c.records[rid].error:
                    with lock:
                        done[0] += 1
        finally:
            c.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / (time.monotonic() - t0)


def probe_ttft(server: TritonServer, shape: Shape, rid: str, timeout_s: float = 300) -> float | None:
    c = StreamClient(server.grpc_url)
    try:
        c.send("llm", rid, "Probe: count to five.", shape.values())
        if not c.wait_finals(timeout_s, ids=[rid]):
            return None
        r = c.records[rid]
        return None if r.error or r.first_response_at is None else r.first_response_at - r.sent_at
    finally:
        c.close()


@dataclass
class Burst:
    sent: int = 0
    finished: int = 0
    refused: int = 0
    other_errors: int = 0
    no_final: int = 0
    extra_finals: int = 0
    refusal_p50_s: float | None = None
    refusal_p99_s: float | None = None
    refusal_max_s: float | None = None
    accepted_ttft_p50_s: float | None = None
    accepted_ttft_p99_s: float | None = None
    examples: tuple = ()


def burst(server: TritonServer, shape: Shape, rate: float, seconds: float, samples: list, stub_pid: int,
          t0: float) -> Burst:
    """Poisson arrivals over a few long-lived streams; RSS sampled meanwhile."""
    streams = [StreamClient(server.grpc_url) for _ in range(8)]
    rng = random.Random(0)
    result = Burst()
    stop_sampling = threading.Event()

    def sampler() -> None:
        while not stop_sampling.wait(2.0):
            samples.append(("burst", round(time.monotonic() - t0, 1), rss_mb(stub_pid), rss_mb(server.pid)))

    threading.Thread(target=sampler, daemon=True).start()
    end = time.monotonic() + seconds
    next_at = time.monotonic()
    while next_at < end:
        time.sleep(max(0.0, next_at - time.monotonic()))
        streams[result.sent % len(streams)].send("llm", f"o{result.sent}", rng.choice(PROMPTS), shape.values())
        result.sent += 1
        next_at += rng.expovariate(rate)
    stop_sampling.set()
    for s in streams:
        s.wait_finals(600)
    refusals, ttfts, examples = [], [], []
    for s in streams:
        for rid, rec in s.records.items():
            if rec.num_finals == 0:
                result.no_final += 1
            elif rec.num_finals > 1:
                result.extra_finals += 1
            elif rec.error and "queue is full" in rec.error:
                result.refused += 1
                refusals.append(rec.final_at - rec.sent_at)
            elif rec.error:
                result.other_errors += 1
                examples.append(f"{rid}: {rec.error[:160]}")
            else:
                result.finished += 1
                ttfts.append(rec.first_response_at - rec.sent_at)
        s.close()
    result.refusal_p50_s, result.refusal_p99_s = p(refusals, 50), p(refusals, 99)
    result.refusal_max_s = max(refusals, default=None)
    result.accepted_ttft_p50_s, result.accepted_ttft_p99_s = p(ttfts, 50), p(ttfts, 99)
    result.examples = tuple(examples[:10])
    return result


def wait_quiescent(server: TritonServer, timeout_s: float = 120) -> list[str]:
    """The pool's size is the engine's own (sized from kv_cache_memory_bytes): read it from the gauges."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server.metrics_url, "llm")
        blocks = int(m.get("inflight:kv_blocks_used", 0) + m.get("inflight:kv_blocks_free", 0))
        problems = quiescence_problems(server, "llm", blocks)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.faults.overload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny-llama instead of SmolLM2-135M-Instruct")
    ap.add_argument("--factor", type=float, default=5.0)
    ap.add_argument("--burst-s", type=float, default=300.0)
    ap.add_argument("--capacity-s", type=float, default=60.0)
    ap.add_argument("--capacity-clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--recovery-s", type=float, default=120.0, help="how long to probe after the burst")
    ap.add_argument("--admission-budget-s", type=float, default=1.0)
    ap.add_argument("--recovery-budget-s", type=float, default=60.0)
    ap.add_argument("--rss-budget-pct", type=float, default=10.0)
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "perf" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    shape = Shape(args.max_tokens)
    model = ROOT / "models" / ("tiny-llama" if args.tiny else "SmolLM2-135M-Instruct")
    out = args.results_dir / f"faults-overload-{args.name}"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        # The product's own config (max_queue_size 256, max_num_seqs 64), only the model path made absolute.
        repo = make_model_repository(ROOT / "model_repository", Path(tmp) / "repo", {"llm": {"model": model}})
        server = TritonServer(repo, log_path=Path(tmp) / "server.log").start()
        try:
            summary = run(server, shape, args)
        finally:
            server.stop()
        summary["leftovers"] = server.leftovers()
    summary["passed"] = summary["passed"] and not summary["leftovers"]
    write(out, args, summary)
    log.info("%s: %s", out / "report.md", "PASSED" if summary["passed"] else "FAILED")
    return 0 if summary["passed"] else 1


def run(server: TritonServer, shape: Shape, args) -> dict:
    stub_pid = next(pid for pid, s in server_stubs(server.pid).items() if s.model == "llm")
    t0 = time.monotonic()
    samples: list[tuple] = []
    probe_ttft(server, shape, "warm")
    cap = capacity(server, shape, args.capacity_clients, args.capacity_s)
    log.info("capacity: %.2f requests/s", cap)
    baseline = [t for t in (probe_ttft(server, shape, f"base{i}") for i in range(10)) if t is not None]
    for _ in range(5):
        samples.append(("baseline", round(time.monotonic() - t0, 1), rss_mb(stub_pid), rss_mb(server.pid)))
        time.sleep(0.2)
    base_p99 = p(baseline, 99) or 0.0
    normal = max(2 * base_p99, base_p99 + 0.25)
    rate = args.factor * cap
    log.info("baseline TTFT p99 %.3f s; burst at %.1f requests/s for %.0f s", base_p99, rate, args.burst_s)
    result = burst(server, shape, rate, args.burst_s, samples, stub_pid, t0)
    burst_end = time.monotonic()
    probes: list[tuple[float, float | None]] = []
    while time.monotonic() - burst_end < args.recovery_s:
        t = probe_ttft(server, shape, f"rec{len(probes)}", timeout_s=args.recovery_s)
        probes.append((round(time.monotonic() - burst_end, 1), t))
        samples.append(("recovery", round(time.monotonic() - t0, 1), rss_mb(stub_pid), rss_mb(server.pid)))
        time.sleep(1.0)
    # Back to normal: from the first probe after which every probe was within `normal`.
    recovered_at = None
    for i, (at, _) in enumerate(probes):
        if all(x is not None and x <= normal for _, x in probes[i:]):
            recovered_at = at
            break
    quiet = wait_quiescent(server)
    base_rss = max((s for _, _, s, _ in samples[:5] if s), default=None)
    peak_rss = max((s for _, _, s, _ in samples if s), default=None)
    base_server = max((v for _, _, _, v in samples[:5] if v), default=None)
    peak_server = max((v for _, _, _, v in samples if v), default=None)
    stub_growth = 100 * (peak_rss - base_rss) / base_rss if base_rss and peak_rss else None
    server_growth = 100 * (peak_server - base_server) / base_server if base_server and peak_server else None
    checks = {
        "every request one final": result.no_final == 0 and result.extra_finals == 0,
        "only data or queue-full refusals": result.other_errors == 0,
        "queue limit refused under overload": result.refused > 0,
        f"refusal p99 <= {args.admission_budget_s} s": (result.refusal_p99_s or 0) <= args.admission_budget_s,
        f"stub RSS peak <= baseline + {args.rss_budget_pct}%": stub_growth is not None
        and stub_growth <= args.rss_budget_pct,
        "server alive after": server.is_running(),
        "quiescent after (pool whole, nothing in flight)": not quiet,
        f"back to normal within {args.recovery_budget_s:.0f} s": recovered_at is not None
        and recovered_at <= args.recovery_budget_s,
    }
    with open(Path(args.results_dir) / f"faults-overload-{args.name}" / "timeline.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["phase", "t_s", "stub_rss_mb", "server_rss_mb"])
        w.writerows(samples)
        w.writerow([])
        w.writerow(["recovery probe at s after burst", "ttft_s"])
        w.writerows(probes)
    return {"capacity_rps": round(cap, 3), "rate_rps": round(rate, 3), "factor": args.factor,
            "burst_s": args.burst_s, "max_tokens": shape.max_tokens, "baseline_ttft_p99_s": base_p99,
            "normal_ttft_s": normal, "burst": asdict(result), "recovered_after_s": recovered_at,
            "recovery_probes": probes, "stub_rss_baseline_mb": base_rss, "stub_rss_peak_mb": peak_rss,
            "stub_rss_growth_pct": stub_growth, "server_rss_baseline_mb": base_server,
            "server_rss_peak_mb": peak_server, "server_rss_growth_pct": server_growth, "checks": checks,
            "quiescence_problems": quiet, "passed": all(checks.values())}


def write(out: Path, args, s: dict) -> None:
    (out / "summary.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
    b = s["burst"]
    fmt = lambda v, d=3: "n/a" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [f"# Overload: {s['factor']:g}x for {s['burst_s'] / 60:.1f} minutes — "
             f"{'PASSED' if s['passed'] else 'FAILED'}", "",
             f"`python -m perf.faults.overload {' '.join(sys.argv[1:])}` on {cpu_model_name()} (2 cores, shared with "
             f"other jobs); model {'tiny-llama' if args.tiny else 'SmolLM2-135M-Instruct'}, `llm` with the product's "
             f"config (one instance, max_queue_size 256, max_num_seqs 64); every request {s['max_tokens']} "
             "tokens, streamed.", "",
             "| what | figure |", "|---|---|",
             f"| capacity (closed loop, {args.capacity_clients} clients) | {s['capacity_rps']:.2f} requests/s |",
             f"| burst arrivals (Poisson) | {s['rate_rps']:.2f} requests/s for {s['burst_s']:.0f} s: "
             f"{b['sent']} sent |",
             f"| finished / refused (queue full) / other errors | {b['finished']} / {b['refused']} / "
             f"{b['other_errors']} |",
             f"| requests without exactly one final | {b['no_final'] + b['extra_finals']} |",
             f"| refusal latency p50 / p99 / max | {fmt(b['refusal_p50_s'])} / {fmt(b['refusal_p99_s'])} / "
             f"{fmt(b['refusal_max_s'])} s (budget {args.admission_budget_s} s) |",
             f"| accepted requests' TTFT p50 / p99 during the burst | {fmt(b['accepted_ttft_p50_s'], 2)} / "
             f"{fmt(b['accepted_ttft_p99_s'], 2)} s |",
             f"| stub RSS baseline -> peak | {fmt(s['stub_rss_baseline_mb'], 0)} -> {fmt(s['stub_rss_peak_mb'], 0)} MB "
             f"({fmt(s['stub_rss_growth_pct'], 1)}%) |",
             f"| tritonserver RSS baseline -> peak | {fmt(s['server_rss_baseline_mb'], 0)} -> "
             f"{fmt(s['server_rss_peak_mb'], 0)} MB ({fmt(s['server_rss_growth_pct'], 1)}%) |",
             f"| idle TTFT p99 (baseline); normal = within | {fmt(s['baseline_ttft_p99_s'])} s; "
             f"{fmt(s['normal_ttft_s'])} s |",
             f"| back to normal after the burst | {fmt(s['recovered_after_s'], 1)} s |", "",
             "| check | result |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in s["checks"].items()]
    lines += ["", "Recovery probes (s after the burst: TTFT s): " +
              ", ".join(f"{at:.0f}: {fmt(t, 2)}" for at, t in s["recovery_probes"][:40])]
    if b["examples"]:
        lines += ["", "Other errors:"] + [f"- {e}" for e in b["examples"]]
    lines += ["", f"Left behind at stop: {s['leftovers'] or 'nothing'}. Files: summary.json, timeline.csv.", ""]
    (out / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
