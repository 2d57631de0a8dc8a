"""Soak results: the verdict (summarize) and the files (report.md, samples.csv, requests.csv,
summary.json, rss.png)."""
from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Sample:
    t_s: float
    stub_rss_mb: float | None
    server_rss_mb: float | None
    kv_used: float | None
    kv_free: float | None
    running: float | None
    waiting: float | None
    inflight: float | None
    finished: float
    preemptions: float | None
    requests_sent: int


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope (units per minute) of (seconds, value) points."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return None if var == 0 else 60 * sum((t - mx) * (v - my) for t, v in points) / var


def summarize(outcomes, samples: list[Sample], missing: int, duplicate: int, examples: list[str],
              quiescence_problems: list[str], engine_bound: int, server_finished: float, num_blocks: int) -> dict:
    by_action: dict[str, dict[str, int]] = {}
    for o in outcomes:
        row = by_action.setdefault(o.action, {"sent": 0, "ok": 0, "failed": 0})
        row["sent"] += 1
        row["ok" if o.ok else "failed"] += 1
    failed = [f"{o.action} {o.request_id}: {o.detail}" for o in outcomes if not o.ok]
    latencies = [o.latency_s for o in outcomes if o.ok and o.latency_s is not None]
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    end = samples[-1]
    # Memory growth after warm-up (the first tenth of the run, at most a minute): allocator pools, the
    # prefix cache and torch's caches fill early; a leak keeps growing.
    warm_at = min(60.0, samples[-1].t_s / 10)
    warm = [s for s in samples if s.t_s >= warm_at and s.stub_rss_mb is not None]
    growth = (warm[-1].stub_rss_mb - warm[0].stub_rss_mb) if len(warm) >= 2 else None
    leaked = None if end.kv_used is None else int(end.kv_used) + max(0, num_blocks - int(end.kv_free or 0))
    summary = {
        "requests": len(outcomes),
        "by_action": by_action,
        "missing_finals": missing,
        "duplicate_finals": duplicate,
        "finals_examples": examples,
        "failed_outcomes": len(failed),
        "failed_examples": failed[:20],
        "engine_bound_requests": engine_bound,
        "server_finished_requests": server_finished,
        "server_count_mismatch": int(server_finished - engine_bound),
        "leaked_blocks": leaked,
        "quiescence_problems": quiescence_problems,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "stub_rss_start_mb": samples[0].stub_rss_mb, "stub_rss_after_warmup_mb": warm[0].stub_rss_mb if warm else None,
        "stub_rss_end_mb": end.stub_rss_mb,
        "stub_rss_max_mb": max((s.stub_rss_mb for s in samples if s.stub_rss_mb is not None), default=None),
        "stub_rss_growth_mb": growth,
        "stub_rss_slope_mb_per_min": slope_per_min([(s.t_s, s.stub_rss_mb) for s in warm]),
        "server_rss_after_warmup_mb": warm[0].server_rss_mb if warm else None,
        "server_rss_end_mb": end.server_rss_mb,
        "preemptions": (end.preemptions or 0) - (samples[0].preemptions or 0),
    }
    summary["passed"] = (missing == 0 and duplicate == 0 and not failed and leaked == 0
                         and summary["server_count_mismatch"] == 0 and not quiescence_problems)
    return summary


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def write_outputs(out_dir: Path, config: dict, summary: dict, samples: list[Sample], outcomes) -> None:
    (out_dir / "summary.json").write_text(json.dumps({"config": config, "summary": summary}, indent=2))
    with open(out_dir / "samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        fields = [fl.name for fl in dataclasses.fields(Sample)]
        w.writerow(fields)
        for s in samples:
            w.writerow([getattr(s, k) for k in fields])
    with open(out_dir / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["action", "request_id", "ok", "latency_s", "ttft_s", "detail"])
        for o in outcomes:
            w.writerow([o.action, o.request_id, int(o.ok), _fmt(o.latency_s, 3), _fmt(o.ttft_s, 3), o.detail[:160]])
    plotted = _plot(out_dir / "rss.png", samples)
    (out_dir / "report.md").write_text(_markdown(config, summary, samples, plotted))


def _plot(path: Path, samples: list[Sample]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [s.t_s / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(t, [s.stub_rss_mb for s in samples], label="model stub RSS (MB)")
    if any(s.server_rss_mb for s in samples):
        ax1.plot(t, [s.server_rss_mb for s in samples], label="tritonserver RSS (MB)")
    ax1.set_ylabel("MB")
    ax1.legend()
    ax2.plot(t, [s.kv_used for s in samples], label="KV blocks used")
    ax2.plot(t, [s.inflight for s in samples], label="requests in flight")
    ax2.set_xlabel("minutes")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _markdown(config: dict, s: dict, samples: list[Sample], plotted: bool) -> str:
    verdict = "PASSED" if s["passed"] and not s.get("leftovers") else "FAILED"
    lines = [
        f"# Soak: {config['duration_s'] / 60:.1f} minutes of mixed traffic — {verdict}",
        "",
        f"Started {config['started']}; model {config['model']}, {config['num_kv_blocks']} KV blocks; "
        f"concurrency {config['concurrency']}; max_tokens up to {config['max_tokens']}; seed {config['seed']}; "
        f"server: {config['server']}. Generated by `python -m perf.soak`.",
        "",
        "## Invariants",
        "",
        "| check | result |",
        "|---|---|",
        f"| requests sent | {s['requests']} |",
        f"| requests without a final (client side) | {s['missing_finals']} |",
        f"| requests with more than one final (client side) | {s['duplicate_finals']} |",
        f"| requests that reached the engine / finished there (server counters) | {s['engine_bound_requests']} / "
        f"{s['server_finished_requests']:.0f} |",
        f"| KV blocks leaked at the end | {s['leaked_blocks']} |",
        f"| quiescent at the end (queues empty, in-flight 0, live, ready) | "
        f"{'yes' if not s['quiescence_problems'] else '; '.join(s['quiescence_problems'])} |",
        f"| outcomes not as expected | {s['failed_outcomes']} |",
        f"| stub/shm left behind | {len(s.get('leftovers') or [])} |",
        "",
        "## Traffic",
        "",
        "| action | sent | as expected | not |",
        "|---|---|---|---|",
    ]
    for action, row in sorted(s["by_action"].items()):
        lines.append(f"| {action} | {row['sent']} | {row['ok']} | {row['failed']} |")
    lines += [
        "",
        "Bad requests must come back as one error each; cancelled ones are counted on the server "
        "(`vllm:request_success_total`), since a cancelled gRPC stream or a dropped HTTP stream never sees its final.",
        "",
        "## Latency (requests that ran to their end)",
        "",
        f"e2e p50 {_fmt(s['latency_p50_s'], 2)} s, p99 {_fmt(s['latency_p99_s'], 2)} s; "
        f"time to first response p50 {_fmt(s['ttft_p50_s'], 2)} s, p99 {_fmt(s['ttft_p99_s'], 2)} s. "
        f"Preemptions: {s['preemptions']:.0f}.",
        "",
        "## Memory (the model's python-backend stub)",
        "",
        f"RSS at start {_fmt(s['stub_rss_start_mb'], 0)} MB, "
        f"after warm-up {_fmt(s['stub_rss_after_warmup_mb'], 0)} MB, "
        f"at the end {_fmt(s['stub_rss_end_mb'], 0)} MB, max {_fmt(s['stub_rss_max_mb'], 0)} MB: growth after "
        f"warm-up {_fmt(s['stub_rss_growth_mb'], 1)} MB "
        f"(least-squares slope {_fmt(s['stub_rss_slope_mb_per_min'], 2)} MB/min). "
        f"tritonserver itself: {_fmt(s.get('server_rss_after_warmup_mb'), 0)} MB after warm-up, "
        f"{_fmt(s.get('server_rss_end_mb'), 0)} MB at the end.",
        "",
    ]
    if plotted:
        lines += ["![stub RSS and KV blocks over time](rss.png)", ""]
    step = max(1, len(samples) // 12)
    lines += ["| t (s) | stub RSS (MB) | KV used | in flight | sent so far |", "|---|---|---|---|---|"]
    for smp in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        lines.append(f"| {smp.t_s:.0f} | {_fmt(smp.stub_rss_mb, 0)} | {_fmt(smp.kv_used, 0)} | "
                     f"{_fmt(smp.inflight, 0)} | {smp.requests_sent} |")
    if s["finals_examples"] or s["failed_examples"]:
        lines += ["", "## Problems", ""] + [f"- {e}" for e in s["finals_examples"] + s["failed_examples"]]
    lines += ["", "Files: `samples.csv` (every sample), `requests.csv` (every request), `summary.json`.", ""]
    return "\n".join(lines)
