"""Markdown reports and plots of the tuner's commands (calibrate, search, verify, prefixes)."""
from __future__ import annotations

import csv
import math
from pathlib import Path

from tuner.cost import FEATURES, FORM, Fit
from tuner.search import SearchResult, pareto

TUNED = ("threads", "max_num_seqs", "max_num_batched_tokens", "fast_lane_share", "block_size",
         "kv_cache_memory_bytes")
FIGURES = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms",
           "e2e_p99_ms", "queue_p50_ms", "queue_p99_ms", "preemptions", "prefix_hit_rate", "kv_peak_use")
# What the server's replay can measure (queue time and KV use are the engine's, not visible to the client).
VERIFIED = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
            "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "preemptions", "prefix_hit_rate", "step_mean_ms", "steps",
            "send_lag_p99_ms")


def _pyplot():
    """matplotlib, imported where a plot is drawn: the serving image does not install it (requirements-serve.txt),
    and every command but the plots works without it."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the tuner's plots need matplotlib, which the serving image does not install: "
                          "pip install matplotlib (the dev venv has it, requirements.txt)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.1f}"
    return str(v)


def opts(o: dict) -> str:
    short = {"max_num_seqs": "seqs", "max_num_batched_tokens": "budget", "fast_lane_share": "fast",
             "block_size": "block", "kv_cache_memory_bytes": "kv"}
    parts = []
    for k in TUNED:
        if k in o:
            v = f"{int(o[k]) >> 20}MiB" if k == "kv_cache_memory_bytes" else o[k]
            parts.append(f"{short.get(k, k)}={v}")
    return " ".join(parts)


# ---- calibrate -----------------------------------------------------------------------------------------------
def calibrate_report(cost: dict, out: Path) -> None:
    lines = [f"# Step-cost calibration: {cost['model']['name']} on {cost['host']['cpu']}", "",
             f"Host {cost['host']['hostname']}, {cost['host']['cpus']} CPUs, torch {cost['host']['torch']}, "
             f"dtype {cost['dtype']}, gemm {cost['host']['cpu_gemm']}, code {cost['code_version']}, "
             f"{cost['created']}.", "", f"Form: `{FORM}`", ""]
    lines += ["| threads | " + " | ".join(FEATURES) + " | knee | points | mean abs rel err | max | 5-fold CV mean | "
              "clock | CPU/wall | load avg (before, after) |", "|---|" + "---:|" * (len(FEATURES) + 8)]
    for t, f in sorted(cost["fits"].items(), key=lambda x: int(x[0])):
        s = f["stats"]
        lines.append(f"| {t} | " + " | ".join(f"{f['coef_ms'].get(k, 0.0):.4g}" for k in FEATURES) +
                     f" | {f.get('knee', 1e9):g}K | {s['points']} | {s['mean_abs_rel_err']:.1%} | "
                     f"{s['max_abs_rel_err']:.1%} | "
                     f"{s['cv_mean_abs_rel_err']:.1%} | {f.get('clock', 'wall')} | {f.get('cpu_per_wall', '')} | "
                     f"{f['load_average']} |")
    lines += ["", "Coefficients in ms per unit (attention terms per 1000 token-positions; the knee in thousands of "
              "decode positions). Each point is the "
              "fastest of its repeats. CPU/wall: the process's CPU time over wall time of the timed steps; with "
              "one thread, well under 1 means other work took the CPU (the wall figures are then inflated). "
              "Measured vs fitted step times: `cost_fit.png`.", ""]
    (out / "cost.md").write_text("\n".join(lines) + "\n")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    for t, f in sorted(cost["fits"].items()):
        meas = [p["step_ms"] for p in f["points"]]
        model = Fit(f["coef_ms"], f.get("knee", 1e9))
        pred = [model.predict_ms(p["features"]) for p in f["points"]]
        ax.scatter(meas, pred, s=12, label=f"{t} thread(s)")
    hi = max(p["step_ms"] for f in cost["fits"].values() for p in f["points"])
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("cost model (ms)")
    ax.set_title("Engine step: measured vs fitted")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cost_fit.png", dpi=110)
    plt.close(fig)


# ---- search --------------------------------------------------------------------------------------------------
def search_report(summary: dict, res: SearchResult, out: Path) -> None:
    sla = summary["sla"]
    with open(out / "configs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(TUNED) + list(FIGURES) + ["meets_sla"])
        for e in res.grid:
            w.writerow([e.options.get(k) for k in TUNED] + [e.figures.get(k) for k in FIGURES] + [e.ok])
    _pareto_plot(res, sla, out / "pareto.png")
    feasible = [e for e in res.grid if e.ok]
    pr, d = summary["predicted"], summary["default"]
    lines = [f"# Tuned config `{summary['name']}` for p99 TTFT <= {sla['ttft_p99_ms']:.0f} ms, p99 ITL <= "
             f"{sla['itl_p99_ms']:.0f} ms at {sla['rate']:.2f} req/s", "",
             f"Trace `{summary['trace']['path']}` ({summary['trace']['requests']} requests, "
             f"{summary['trace']['output_tokens']} output tokens), cost model `{summary['cost']['path']}` "
             f"({summary['cost']['host']}, code {summary['cost']['code_version']}; engine step x "
             f"{_scales(summary['cost'].get('server_step_scale', 1.0))} in the server).", "",
             f"Searched {summary['search']['configs']} configs at the trace's rate in "
             f"{summary['search']['grid_seconds']:.1f} s ({summary['search']['configs_per_s']:.1f} configs/s, "
             f"{summary['search']['workers']} workers); {summary['search']['simulations']} simulations in all, "
             f"{summary['search']['seconds']:.1f} s. {len(feasible)} configs meet the SLA at the trace's rate.", "",
             f"**Chosen** ({summary['config_path']}): `{opts(summary['chosen'])}`" +
             (f", serve with `OMP_NUM_THREADS={summary['chosen']['threads']}`" if 'threads' in summary['chosen']
              else ""), ""]
    if not res.sla_met:
        lines += ["**No config meets the SLA at this rate** (predicted). The chosen one is the closest; it meets "
                  f"the SLA up to {summary['max_rate']['rate']:.2f} req/s.", ""]
    lines += ["| | chosen | default |", "|---|---:|---:|",
              f"| options | {opts(summary['chosen'])} | {opts(d['options'])} |"]
    for k in FIGURES:
        lines.append(f"| {k} at {sla['rate']:.2f} req/s | {fmt(pr.get(k))} | {fmt(d['predicted'].get(k))} |")
    lines.append(f"| meets the SLA at the trace's rate | {res.chosen_at_rate.ok} | {res.default.ok} |")
    mr, dmr = summary["max_rate"], d["max_rate"]
    cap = " (the trace's limit: x16)" if mr.get("at_cap") else ""
    lines.append(f"| highest rate meeting the SLA (req/s) | {mr['rate']:.2f}{cap} | {dmr['rate']:.2f} |")
    if mr.get("predicted"):
        lines.append(f"| output tok/s at that rate | {mr['predicted']['output_tok_s']:.1f} | |")
    lines += ["", "## Why it wins", ""] + [f"- {r}" for r in why(summary, res)]
    lines += ["", "## Pareto front at the trace's rate (throughput vs p99 TTFT)", "", "![pareto](pareto.png)", "",
              "| config | output tok/s | p99 TTFT ms | p99 ITL ms | meets SLA |", "|---|---:|---:|---:|---|"]
    pts = [(e.figures["output_tok_s"], e.figures["ttft_p99_ms"]) for e in res.grid]
    for i in pareto(pts)[:15]:
        e = res.grid[i]
        lines.append(f"| {opts(e.options)} | {e.figures['output_tok_s']:.1f} | {e.figures['ttft_p99_ms']:.0f} | "
                     f"{e.figures['itl_p99_ms']:.0f} | {e.ok} |")
    if res.kv_steps:
        lines += ["", "## KV pool", "", "Smallest pool first, at the chosen config's highest rate:", "",
                  "| pool | blocks | meets SLA | preemptions | p99 TTFT ms | stopped |", "|---|---:|---|---:|---:|---|"]
        for e in res.kv_steps:
            lines.append(f"| {int(e.options['kv_cache_memory_bytes']) >> 20} MiB | {e.figures['kv_blocks']} | {e.ok} | "
                         f"{e.figures['preemptions']} | {e.figures['ttft_p99_ms']:.0f} | {e.stopped or ''} |")
    lines += ["", "All configs: `configs.csv`. Figures are predictions (virtual time); `python -m tuner verify` "
              "measures them on the server."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def why(summary: dict, res: SearchResult) -> list[str]:
    sla = summary["sla"]
    out = []
    d = res.default
    if not d.ok:
        bad = []
        if d.figures["ttft_p99_ms"] > sla["ttft_p99_ms"]:
            bad.append(f"p99 TTFT {d.figures['ttft_p99_ms']:.0f} ms")
        if d.figures["itl_p99_ms"] > sla["itl_p99_ms"]:
            bad.append(f"p99 ITL {d.figures['itl_p99_ms']:.0f} ms")
        if d.figures["requests_done"] < d.figures["requests"]:
            bad.append(f"{d.figures['requests'] - d.figures['requests_done']} requests refused")
        out.append(f"The default config misses the SLA at this rate: {', '.join(bad)}.")
    else:
        out.append(f"The default config meets the SLA at this rate, up to {summary['default']['max_rate']['rate']:.2f} "
                   f"req/s; the chosen one up to {summary['max_rate']['rate']:.2f} req/s.")
    by_option: dict[str, list[str]] = {}
    for name, value, ev in res.neighbours:
        f = ev.figures
        verdict = "still meets it" if ev.ok else (
            f"breaks it (p99 TTFT {f['ttft_p99_ms']:.0f} ms, p99 ITL {f['itl_p99_ms']:.0f} ms"
            + (f", {f['preemptions']} preemptions" if f["preemptions"] else "") + ")")
        by_option.setdefault(name, []).append(f"{value}: {verdict}")
    rate = summary["max_rate"]["rate"]
    for name, items in by_option.items():
        out.append(f"`{name}={summary['chosen'][name]}`; at {rate:.2f} req/s, " + "; ".join(items) + ".")
    return out


def _pareto_plot(res: SearchResult, sla: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for ok, color, label in ((False, "#bbbbbb", "misses SLA"), (True, "#2b7bba", "meets SLA")):
        pts = [(e.figures["ttft_p99_ms"], e.figures["output_tok_s"]) for e in res.grid if e.ok == ok]
        if pts:
            ax.scatter(*zip(*pts), s=10, c=color, label=label)
    front = pareto([(e.figures["output_tok_s"], e.figures["ttft_p99_ms"]) for e in res.grid])
    fx = sorted((res.grid[i].figures["ttft_p99_ms"], res.grid[i].figures["output_tok_s"]) for i in front)
    ax.plot(*zip(*fx), "k-", lw=1, label="Pareto front")
    c, d = res.chosen_at_rate.figures, res.default.figures
    ax.scatter([c["ttft_p99_ms"]], [c["output_tok_s"]], marker="*", s=200, c="#d62728", label="chosen", zorder=5)
    ax.scatter([d["ttft_p99_ms"]], [d["output_tok_s"]], marker="X", s=90, c="#ff7f0e", label="default", zorder=5)
    ax.axvline(sla["ttft_p99_ms"], color="#d62728", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("p99 TTFT (ms, log)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{len(res.grid)} configs at {sla['rate']:.2f} req/s (predicted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- verify --------------------------------------------------------------------------------------------------
def verify_report(summary: dict, out: Path) -> None:
    v = summary["verification"]
    sla = summary["sla"]
    lines = [f"# Verification of `{summary['name']}` on tritonserver", "",
             f"Trace `{v['trace']}`: the {v['requests']} requests arriving from {v.get('start_s', 0):.0f} s to "
             f"{v.get('start_s', 0) + v['duration_s']:.0f} s, sent at their arrival times over one streaming gRPC "
             f"connection; greedy, ignore_eos; first, {v.get('warm_up_requests', 2)} warm-up prompts (those before "
             f"the window, the window's first, a short one; 4 tokens each) on both the server and the simulator. "
             f"Predictions are simulations of exactly these requests. Load average (1, 5, 15 min before; after): "
             f"chosen {summary['measured'].get('load_average')}, default "
             f"{summary['default_measured'].get('load_average')}.", "",
             "| figure | chosen predicted | chosen measured | error | default predicted | default measured | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k in VERIFIED:
        a, b = v["predicted_replay"].get(k), summary["measured"].get(k)
        c, e = v["default_predicted_replay"].get(k), summary["default_measured"].get(k)
        lines.append(f"| {k} | {fmt(a)} | {fmt(b)} | {_err(a, b)} | {fmt(c)} | {fmt(e)} | {_err(c, e)} |")
    ratio = v.get("step_time_ratio") or {}
    if v.get("predicted_replay_rescaled"):
        lines += ["", f"Measured mean step time over predicted: chosen {ratio.get('chosen', 0):.2f}x, default "
                  f"{ratio.get('default', 0):.2f}x. Predictions with every step scaled by that ratio (what is left "
                  "is the scheduling model's error, not the step cost's):", "",
                  "| figure | chosen rescaled | measured | error | default rescaled | measured | error |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p99_ms"):
            a, b = v["predicted_replay_rescaled"].get(k), summary["measured"].get(k)
            c, e = (v.get("default_predicted_replay_rescaled") or {}).get(k), summary["default_measured"].get(k)
            lines.append(f"| {k} | {fmt(a)} | {fmt(b)} | {_err(a, b)} | {fmt(c)} | {fmt(e)} | {_err(c, e)} |")
    lines += ["", f"SLA p99 TTFT <= {sla['ttft_p99_ms']:.0f} ms, p99 ITL <= {sla['itl_p99_ms']:.0f} ms: "
              f"chosen **{'held' if v['sla_held'] else 'missed'}**, default "
              f"**{'held' if v['default_sla_held'] else 'missed'}** (measured).", ""]
    (out / "verify.md").write_text("\n".join(lines) + "\n")


def _scales(scale) -> str:
    if isinstance(scale, dict):
        return ", ".join(f"{v:g} at {t} thread(s)" for t, v in sorted(scale.items()))
    return f"{scale:g}"


def _err(pred, meas) -> str:
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (pred, meas)) or not pred:
        return ""
    return f"{(meas - pred) / pred:+.0%}"


# ---- prefixes ------------------------------------------------------------------------------------------------
def prefix_report(log: str, rows, choice: dict, reasons: list[str], num_prompts: int, num_tokens: int,
                  in_flight: int, out: Path) -> None:
    pools = sorted({r.pool_mib for r in rows})
    sizes = sorted({r.block_size for r in rows})
    lines = [f"# Prefix caching on `{log}`", "", f"{num_prompts} prompts, {num_tokens} prompt tokens; "
             f"replayed through the engine's BlockManager with {in_flight} requests holding blocks at once.", "",
             "Hit rate (share of prompt tokens served from the cache) by block size and KV pool:", "",
             "| block size | " + " | ".join(f"{p:g} MiB" for p in pools) + " |", "|---|" + "---:|" * len(pools)]
    for bs in sizes:
        cells = {r.pool_mib: r for r in rows if r.block_size == bs}
        row = " | ".join(f"{cells[p].hit_rate:.1%} ({cells[p].hit_tokens})" if not cells[p].skipped
                         else f"({cells[p].skipped} prompts never fit)" for p in pools)
        lines.append(f"| {bs} | {row} |")
    lines += ["", "(in parentheses: prefill tokens saved)", "", "## Recommendation", "",
              f"`enable_prefix_caching={str(choice['enable_prefix_caching']).lower()}`, "
              f"`block_size={choice['block_size']}`", ""] + [f"- {r}" for r in reasons]
    (out / "report.md").write_text("\n".join(lines) + "\n")
