"""Soak results: the verdict (summarize) and the files (report.md, samples.csv, requests.csv, summary.json,
rss.png). Memory is per process (every python-backend stub by its Triton instance name, and tritonserver), the
KV pool per engine instance."""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

RSS_GROWTH_LIMIT_PCT = 5.0  # the target for a long run, after warm-up
# Memory is judged on runs at least this long: in a shorter one (the test suite's 30 s) allocator pools and
# caches are still filling after the warm-up, and their growth says nothing about a leak.
RSS_JUDGED_MIN_S = 300.0


@dataclass
class Sample:
    t_s: float
    rss_mb: dict[str, float]  # process -> RSS: stubs by instance name (llm_0_1), "tritonserver"
    kv: dict[str, tuple[float, float]]  # engine instance -> (blocks used, blocks free)
    running: float | None
    waiting: float | None
    inflight: float | None
    finished: float
    preemptions: float | None
    requests_sent: int

    @property
    def kv_used(self) -> float | None:
        return sum(u for u, _ in self.kv.values()) if self.kv else None


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


def warmup_s(duration_s: float) -> float:
    """Allocator pools, the prefix cache, pages of the KV pool touched for the first time and torch's caches grow
    early; a leak keeps growing. A tenth of the run, at most 10 minutes."""
    return min(600.0, duration_s / 10)


def memory(samples: list[Sample]) -> dict[str, dict]:
    """Per process: RSS at start, after warm-up, at the end, max, growth (MB and %), slope over the second half."""
    if not samples:
        return {}
    duration = samples[-1].t_s
    warm_at = warmup_s(duration)
    out = {}
    for name in sorted({k for s in samples for k in s.rss_mb}):
        points = [(s.t_s, s.rss_mb[name]) for s in samples if name in s.rss_mb]
        warm = [(t, v) for t, v in points if t >= warm_at]
        if not warm:
            continue
        growth = warm[-1][1] - warm[0][1]
        out[name] = {"start_mb": round(points[0][1], 1), "after_warmup_mb": round(warm[0][1], 1),
                     "end_mb": round(warm[-1][1], 1), "max_mb": round(max(v for _, v in points), 1),
                     "growth_mb": round(growth, 1), "growth_pct": round(100 * growth / warm[0][1], 2),
                     "slope_mb_per_min_second_half": slope_per_min([(t, v) for t, v in points if t >= duration / 2])}
    return out


def ttft_drift(outcomes, t0: float, duration_s: float) -> dict:
    """p99 time to first token of the requests sent in the first window vs the last (a tenth of the run, at most
    10 minutes each)."""
    window = min(600.0, max(duration_s / 10, 1.0))
    first = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None and o.sent_s - t0 <= window]
    last = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None and o.sent_s - t0 >= duration_s - window]
    p_first, p_last = percentile(first, 99), percentile(last, 99)
    drift = None if not p_first or p_last is None else round(100 * (p_last - p_first) / p_first, 1)
    return {"window_s": window, "first_n": len(first), "last_n": len(last), "first_p99_s": p_first,
            "last_p99_s": p_last, "drift_pct": drift}


@dataclass
class Accounting:
    """What the server counted against what the clients sent (perf.soak.run fills it)."""
    engine_bound: int
    server_finished: float
    pool_per_instance: int
    kv_end: dict[str, tuple[float, float]] = field(default_factory=dict)
    quiescence_problems: list[str] = field(default_factory=list)


def over_limit(mem: dict[str, dict], limit_pct: float) -> dict[str, float]:
    """Processes whose RSS grew by more than limit_pct after the warm-up: process -> growth %."""
    return {name: m["growth_pct"] for name, m in mem.items() if m["growth_pct"] > limit_pct}


def summarize(outcomes, samples: list[Sample], missing: int, duplicate: int, examples: list[str],
              accounting: Accounting, t0: float, duration_s: float,
              rss_growth_limit_pct: float = RSS_GROWTH_LIMIT_PCT) -> dict:
    by_action: dict[str, dict[str, int]] = {}
    by_cause: dict[str, int] = {}
    for o in outcomes:
        row = by_action.setdefault(o.action, {"sent": 0, "ok": 0, "failed": 0})
        row["sent"] += 1
        row["ok" if o.ok else "failed"] += 1
        by_cause[o.cause] = by_cause.get(o.cause, 0) + 1
    failed = [f"{o.action} {o.request_id}: {o.detail}" for o in outcomes if not o.ok]
    latencies = [o.latency_s for o in outcomes if o.ok and o.latency_s is not None]
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    pool = accounting.pool_per_instance
    leaked_by_instance = {inst: int(used) + max(0, pool - int(free))
                          for inst, (used, free) in accounting.kv_end.items()}
    mem = memory(samples)
    rss_judged = bool(samples) and samples[-1].t_s >= RSS_JUDGED_MIN_S
    stubs = {k: v for k, v in mem.items() if k != "tritonserver"}
    summary = {
        "requests": len(outcomes),
        "by_action": by_action,
        "by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1])),
        "missing_finals": missing,
        "duplicate_finals": duplicate,
        "finals_examples": examples,
        "failed_outcomes": len(failed),
        "failed_examples": failed[:20],
        "engine_bound_requests": accounting.engine_bound,
        "server_finished_requests": accounting.server_finished,
        "server_count_mismatch": int(accounting.server_finished - accounting.engine_bound),
        "kv_pool_per_instance": pool,
        "kv_end_by_instance": {k: list(v) for k, v in accounting.kv_end.items()},
        "leaked_blocks_by_instance": leaked_by_instance,
        "leaked_blocks": sum(leaked_by_instance.values()) if leaked_by_instance else None,
        "quiescence_problems": accounting.quiescence_problems,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "ttft_drift": ttft_drift(outcomes, t0, duration_s),
        "memory": mem,
        "warmup_s": warmup_s(samples[-1].t_s) if samples else 0,
        "stub_rss_growth_mb": max((v["growth_mb"] for v in stubs.values()), default=None),
        "rss_growth_max_pct": max((v["growth_pct"] for v in mem.values()), default=None),
        "rss_growth_limit_pct": rss_growth_limit_pct,
        "rss_judged": rss_judged,
        "rss_over_limit": over_limit(mem, rss_growth_limit_pct) if rss_judged else {},
        "preemptions": ((samples[-1].preemptions or 0) - (samples[0].preemptions or 0)) if samples else 0,
        "alerts": [],
    }
    summary["passed"] = (missing == 0 and duplicate == 0 and not failed and summary["leaked_blocks"] == 0
                         and summary["server_count_mismatch"] == 0 and not accounting.quiescence_problems
                         and not summary["rss_over_limit"])
    return summary


def _unreachable(s: dict) -> str:
    times = [f"t={u['t_s']:.0f} s" for u in s.get("metrics_unreachable") or []]
    return ", ".join(times) if times else "0"


def _over_limit(s: dict) -> str:
    over = s.get("rss_over_limit") or {}
    return ", ".join(f"{name} {pct:+.2f}%" for name, pct in over.items()) if over else "none"


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def write_outputs(out_dir: Path, config: dict, summary: dict, samples: list[Sample], outcomes) -> None:
    (out_dir / "summary.json").write_text(json.dumps({"config": config, "summary": summary}, indent=2))
    procs = sorted({k for s in samples for k in s.rss_mb})
    instances = sorted({k for s in samples for k in s.kv})
    with open(out_dir / "samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "requests_sent", "finished", "running", "waiting", "inflight", "preemptions"]
                   + [f"rss_mb_{p}" for p in procs] + [f"kv_used_{i}" for i in instances]
                   + [f"kv_free_{i}" for i in instances])
        for s in samples:
            w.writerow([s.t_s, s.requests_sent, s.finished, s.running, s.waiting, s.inflight, s.preemptions]
                       + [_fmt(s.rss_mb.get(p), 1) for p in procs]
                       + [_fmt(s.kv.get(i, (None, None))[0], 0) for i in instances]
                       + [_fmt(s.kv.get(i, (None, None))[1], 0) for i in instances])
    with open(out_dir / "requests.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["action", "request_id", "ok", "cause", "latency_s", "ttft_s", "detail"])
        for o in outcomes:
            w.writerow([o.action, o.request_id, int(o.ok), o.cause, _fmt(o.latency_s, 3), _fmt(o.ttft_s, 3),
                        o.detail[:160]])
    plotted = _plot(out_dir / "rss.png", samples, procs, instances)
    (out_dir / "report.md").write_text(_markdown(config, summary, samples, procs, plotted))


def _plot(path: Path, samples: list[Sample], procs: list[str], instances: list[str]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [s.t_s / 60 for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for p in procs:
        ax1.plot(t, [s.rss_mb.get(p) for s in samples], label=p)
    ax1.set_ylabel("RSS (MB)")
    ax1.set_title("python-backend stubs (by Triton instance) and tritonserver")
    ax1.legend(fontsize=7, ncol=2)
    for i in instances:
        ax2.plot(t, [s.kv.get(i, (None, None))[0] for s in samples], label=f"KV blocks used {i}")
    ax2.plot(t, [s.inflight for s in samples], label="requests in flight (llm)", linestyle=":")
    ax2.set_xlabel("minutes")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _markdown(config: dict, s: dict, samples: list[Sample], procs: list[str], plotted: bool) -> str:
    verdict = "PASSED" if s["passed"] and not s.get("leftovers") else "FAILED"
    leaked = s["leaked_blocks_by_instance"]
    lines = [
        f"# Soak: {config['duration_s'] / 60:.1f} minutes of mixed traffic — {verdict}",
        "",
        f"Started {config['started']}; model {config['model']}, {config['num_kv_blocks']} KV blocks per engine "
        f"instance; concurrency {config['concurrency']}; max_tokens up to {config['max_tokens']}; mix "
        f"{config.get('mix', 'host')}; seed {config['seed']}; server: {config['server']}; CPU: "
        f"{config.get('cpu', 'n/a')}. Generated by `python -m perf.soak`.",
        "",
        "## Invariants",
        "",
        "| check | result |",
        "|---|---|",
        f"| requests sent | {s['requests']} |",
        f"| requests without a final (client side) | {s['missing_finals']} |",
        f"| requests with more than one final (client side) | {s['duplicate_finals']} |",
        f"| requests that reached an engine / finished there (server counters) | {s['engine_bound_requests']} / "
        f"{s['server_finished_requests']:.0f} |",
        f"| KV blocks leaked at the end | {s['leaked_blocks']} |",
        f"| KV pool whole at the end, per engine instance | "
        f"{', '.join(f'{k}: {v} leaked' for k, v in leaked.items()) or 'n/a'} |",
        f"| quiescent at the end (queues empty, in-flight 0, live, ready) | "
        f"{'yes' if not s['quiescence_problems'] else '; '.join(s['quiescence_problems'])} |",
        f"| outcomes not as expected | {s['failed_outcomes']} |",
        f"| RSS growth after the warm-up over {_fmt(s.get('rss_growth_limit_pct'))}% (any process) | "
        f"{_over_limit(s) if s.get('rss_judged') else f'not judged: runs under {RSS_JUDGED_MIN_S / 60:.0f} minutes'} |",
        f"| samples the server's metrics did not answer (a restart, a hang) | {_unreachable(s)} |",
        f"| stub/shm left behind, or an unclean stop | {len(s.get('leftovers') or [])} |",
        f"| alerts that fired | {len([a for a in s['alerts'] if a['state'] == 'firing'])} |",
        "",
        "## Traffic",
        "",
        "| action | sent | as expected | not |",
        "|---|---|---|---|",
    ]
    for action, row in sorted(s["by_action"].items()):
        lines.append(f"| {action} | {row['sent']} | {row['ok']} | {row['failed']} |")
    lines += ["", "How each request ended (client side):", "", "| cause | requests |", "|---|---|"]
    lines += [f"| {cause} | {n} |" for cause, n in s["by_cause"].items()]
    d = s["ttft_drift"]
    lines += [
        "",
        "Bad requests must come back as one error each; cancelled ones are counted on the server "
        "(`vllm:request_success_total`), since a cancelled gRPC stream or a dropped HTTP stream never sees its final.",
        "",
        "## Latency (requests that ran to their end)",
        "",
        f"e2e p50 {_fmt(s['latency_p50_s'], 2)} s, p99 {_fmt(s['latency_p99_s'], 2)} s; "
        f"time to first token p50 {_fmt(s['ttft_p50_s'], 2)} s, p99 {_fmt(s['ttft_p99_s'], 2)} s. "
        f"Preemptions: {s['preemptions']:.0f}.",
        "",
        f"TTFT drift: p99 {_fmt(d['first_p99_s'], 2)} s in the first {d['window_s'] / 60:.1f} minutes "
        f"({d['first_n']} requests), {_fmt(d['last_p99_s'], 2)} s in the last ({d['last_n']}): "
        f"{_fmt(d['drift_pct'], 1)}%.",
        "",
        f"## Memory (RSS after a warm-up of {s['warmup_s'] / 60:.1f} minutes)",
        "",
        "| process | start MB | after warm-up | end | max | growth MB | growth % | slope, 2nd half (MB/min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in s["memory"].items():
        lines.append(f"| {name} | {m['start_mb']:.0f} | {m['after_warmup_mb']:.0f} | {m['end_mb']:.0f} | "
                     f"{m['max_mb']:.0f} | {m['growth_mb']:+.1f} | {m['growth_pct']:+.2f} | "
                     f"{_fmt(m['slope_mb_per_min_second_half'], 3)} |")
    lines.append("")
    if plotted:
        lines += ["![RSS per process and KV blocks per engine over time](rss.png)", ""]
    step = max(1, len(samples) // 12)
    lines += ["| t (s) | " + " | ".join(f"{p} MB" for p in procs) + " | KV used | in flight | sent so far |",
              "|---|" + "---|" * (len(procs) + 3)]
    for smp in samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else []):
        lines.append(f"| {smp.t_s:.0f} | " + " | ".join(_fmt(smp.rss_mb.get(p), 0) for p in procs) +
                     f" | {_fmt(smp.kv_used, 0)} | {_fmt(smp.inflight, 0)} | {smp.requests_sent} |")
    if s["alerts"] or config.get("prometheus"):
        lines += ["", "## Alerts (docker/prometheus/alerts.yml, evaluated by Prometheus scraping the server)", ""]
        lines += [f"- {a['name']} {a['state']} from t={a['from_s']:.0f} s to t={a['to_s']:.0f} s {a['labels']}"
                  for a in s["alerts"]] or ["None pending, none fired."]
    if s["finals_examples"] or s["failed_examples"] or s.get("leftovers"):
        lines += ["", "## Problems", ""] + [f"- {e}" for e in s["finals_examples"] + s["failed_examples"]
                                             + list(s.get("leftovers") or [])]
    lines += ["", "Files: `samples.csv` (every sample), `requests.csv` (every request), `summary.json`.", ""]
    return "\n".join(lines)
