"""The A/B report: Markdown (per arm per concurrency, ratios against the theoretical ceiling), CSV, PNG plots."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from perf.ab.metrics import CellStats

ARMS = ("inflight", "dynamic")


@dataclass
class Cell:
    workload: str
    concurrency: int
    arm: str  # "inflight" or "dynamic"
    model: str
    stats: CellStats | None = None
    error: str = ""
    batches: dict[int, int] = field(default_factory=dict)  # dynamic arm: batch size -> count
    steps: dict[str, float] = field(default_factory=dict)  # in-flight arm: engine steps, step seconds, tokens

    @property
    def step_summary(self) -> str:
        n = self.steps.get("steps", 0)
        if not n:
            return ""
        return f"{1e3 * self.steps['step_s'] / n:.0f} ms/step, {self.steps['tokens'] / n:.1f} tok/step"

    @property
    def mean_batch(self) -> float:
        n = sum(self.batches.values())
        return sum(k * v for k, v in self.batches.items()) / n if n else float("nan")


@dataclass
class WorkloadInfo:
    name: str
    description: str
    prompt_tokens: int
    prefix_tokens: int
    output_lengths: list[int]
    ceiling: float


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{digits}f}"


def ratios(cells: list[Cell]) -> dict[tuple[str, int], dict[str, float]]:
    """(workload, concurrency) -> in-flight/dynamic throughput ratios and dynamic/in-flight latency ratios."""
    by = {(c.workload, c.concurrency, c.arm): c.stats for c in cells if c.stats is not None}
    out = {}
    for (w, n, arm), s in by.items():
        d = by.get((w, n, "dynamic"))
        if arm != "inflight" or d is None:
            continue
        out[(w, n)] = {
            "tokens": s.tokens_per_s / d.tokens_per_s, "requests": s.requests_per_s / d.requests_per_s,
            "ttft_p99": d.ttft_p99_ms / s.ttft_p99_ms, "ttft_p50": d.ttft_p50_ms / s.ttft_p50_ms,
            "e2e_p99": d.e2e_p99_ms / s.e2e_p99_ms}
    return out


def write_csv(cells: list[Cell], workloads: dict[str, WorkloadInfo], path: Path) -> None:
    names = CellStats.names()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["workload", "concurrency", "arm", "model", *names, "mean_batch_size", "ceiling", "error"])
        for c in cells:
            values = [getattr(c.stats, n) for n in names] if c.stats else [""] * len(names)
            writer.writerow([c.workload, c.concurrency, c.arm, c.model, *values,
                             "" if c.arm == "inflight" else _f(c.mean_batch, 2), f"{workloads[c.workload].ceiling:.3f}",
                             c.error.splitlines()[0] if c.error else ""])


def read_csv(path: Path) -> list[Cell]:
    """The cells of a results.csv (what plot() needs), to redraw the plots of an earlier run."""
    cells = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            stats = None
            if row["tokens_per_s"]:
                stats = CellStats(**{n: (int if n.startswith("num_") or n == "output_tokens" else float)(row[n])
                                     for n in CellStats.names()})
            cells.append(Cell(row["workload"], int(row["concurrency"]), row["arm"], row["model"], stats, row["error"]))
    return cells


_STYLE = {"inflight": ("tab:blue", "o", "in-flight (llm)"), "dynamic": ("tab:orange", "s", "dynamic (llm_ensemble)")}
_LATENCIES = [("ttft", "TTFT (ms)"), ("itl", "inter-token latency (ms)"), ("e2e", "end-to-end latency (ms)")]


def _series(cells: list[Cell], workload: str, arm: str, attr: str) -> tuple[list[int], list[float]]:
    pts = sorted((c.concurrency, getattr(c.stats, attr)) for c in cells
                 if c.workload == workload and c.arm == arm and c.stats)
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw_throughput(ax, cells: list[Cell], w: str, _col: int) -> None:
    for arm in ARMS:
        color, marker, label = _STYLE[arm]
        ax.plot(*_series(cells, w, arm, "tokens_per_s"), color=color, marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set(title=w, xlabel="concurrency", ylabel="output tokens/s")


def _draw_latency(ax, cells: list[Cell], w: str, col: int) -> None:
    metric, title = _LATENCIES[col]
    for arm in ARMS:
        color, marker, label = _STYLE[arm]
        for q, ls, face in (("p50", "--", "none"), ("p99", "-", color)):  # hollow markers for p50
            ax.plot(*_series(cells, w, arm, f"{metric}_{q}_ms"), color=color, marker=marker, linestyle=ls,
                    markerfacecolor=face, label=f"{label} {q}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{w}: {title}", fontsize=9)
    ax.set_xlabel("concurrency")


def _draw_tradeoff(ax, cells: list[Cell], w: str, _col: int) -> None:
    for arm in ARMS:
        color, marker, label = _STYLE[arm]
        pts = sorted((c.stats.tokens_per_s, c.stats.ttft_p99_ms, c.concurrency) for c in cells
                     if c.workload == w and c.arm == arm and c.stats)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=label)
        for x, y, n in pts:
            ax.annotate(str(n), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.set_title(f"{w}: p99 TTFT vs throughput", fontsize=9)
    ax.set(xlabel="output tokens/s", ylabel="p99 TTFT (ms)")


def plot(cells: list[Cell], workloads: list[str], out_dir: Path) -> list[str]:
    """Three figures, one row per workload where a figure has several panels per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in workloads if any(c.workload == w and c.stats for c in cells)]
    if not names:
        return []
    n = len(names)
    figures = [  # file, workloads as rows (else as columns), columns, figure size, draw(ax, cells, w, column)
        ("throughput_vs_concurrency.png", False, n, (4.2 * n, 3.6), _draw_throughput),
        ("latency_percentiles.png", True, len(_LATENCIES), (12, 3.2 * n), _draw_latency),
        ("latency_vs_throughput.png", False, n, (4.2 * n, 3.6), _draw_tradeoff),
    ]
    for filename, by_row, cols, size, draw in figures:
        rows = n if by_row else 1
        fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
        for r in range(rows):
            for c in range(cols):
                draw(axes[r][c], cells, names[r] if by_row else names[c], c if by_row else 0)
        axes[0][0].legend(fontsize=7 if by_row else 8)
        fig.tight_layout()
        fig.savefig(out_dir / filename, dpi=110)
        plt.close(fig)
    return [f[0] for f in figures]


def write_markdown(cells: list[Cell], workloads: dict[str, WorkloadInfo], genai: list[dict], meta: dict,
                   plots: list[str], path: Path) -> None:
    lines = [f"# A/B: in-flight batching vs Triton's dynamic batcher — {meta['name']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "name"]
    lines += ["", "Arms: **in-flight** = model `llm` (decoupled, one engine loop, requests join and leave every "
              "step); **dynamic** = `llm_ensemble` (preprocessing -> `llm_dynamic` -> postprocessing; Triton's "
              "dynamic batcher forms a batch, execute() runs it as one static batch to completion on the same "
              "engine code, model and kernels). Identical inputs through perf_analyzer (`-i grpc --streaming "
              "--input-data`, bounded by `--request-count`), greedy, `ignore_eos` so output lengths are exact.",
              "", "## Ratios (in-flight over dynamic)", "",
              "Throughput ratio = in-flight tokens/s / dynamic tokens/s; TTFT ratio = dynamic p99 TTFT / in-flight "
              "p99 TTFT (how many times lower in-flight is). Ceiling = max output length / mean output length of the "
              "workload: what in-flight batching can gain at most over static batches of that mix.", "",
              "| workload | concurrency | tokens/s ratio | requests/s ratio | p99 TTFT ratio | p50 TTFT ratio | "
              "p99 e2e ratio | ceiling | fraction of ceiling | mean dynamic batch |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dyn = {(c.workload, c.concurrency): c for c in cells if c.arm == "dynamic"}
    for (w, n), r in sorted(ratios(cells).items(), key=lambda kv: (list(workloads).index(kv[0][0]), kv[0][1])):
        ceiling = workloads[w].ceiling
        lines.append(f"| {w} | {n} | {_f(r['tokens'], 2)}x | {_f(r['requests'], 2)}x | {_f(r['ttft_p99'], 2)}x | "
                     f"{_f(r['ttft_p50'], 2)}x | {_f(r['e2e_p99'], 2)}x | {_f(ceiling, 2)} | "
                     f"{_f(100 * r['tokens'] / ceiling, 0)}% | {_f(dyn[(w, n)].mean_batch, 1)} |")
    lines += ["", "## Per arm, per concurrency", ""]
    for w, info in workloads.items():
        lengths = sorted(set(info.output_lengths))
        lines += [f"### {w}: {info.description}", "",
                  f"Prompt ~{info.prompt_tokens} tokens" + (f" after a shared prefix of ~{info.prefix_tokens}"
                                                             if info.prefix_tokens else "")
                  + f"; output lengths {lengths}; ceiling {info.ceiling:.2f}.", "",
                  "| concurrency | arm | requests | errors | tokens/s | requests/s | TTFT p50 | TTFT p99 | "
                  "ITL p50 | ITL p99 | e2e p50 | e2e p99 | engine |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in sorted((c for c in cells if c.workload == w), key=lambda c: (c.concurrency, c.arm != "inflight")):
            if c.stats is None:
                lines.append(f"| {c.concurrency} | {c.arm} | failed: {c.error.splitlines()[0] if c.error else '?'} "
                             "| | | | | | | | | | |")
                continue
            s = c.stats
            seen = (", ".join(f"{k}x{v}" for k, v in sorted(c.batches.items())) if c.arm == "dynamic"
                    else c.step_summary)
            lines.append(f"| {c.concurrency} | {c.arm} | {s.num_requests} | {s.num_errors} | {_f(s.tokens_per_s)} | "
                         f"{_f(s.requests_per_s, 2)} | {_f(s.ttft_p50_ms, 0)} | {_f(s.ttft_p99_ms, 0)} | "
                         f"{_f(s.itl_p50_ms)} | {_f(s.itl_p99_ms)} | {_f(s.e2e_p50_ms, 0)} | "
                         f"{_f(s.e2e_p99_ms, 0)} | {seen} |")
        lines.append("")
    lines += ["Latencies in ms. Throughput over the steady window (first to last request sent, every client busy); "
              "TTFT, ITL (per request: (last - first token time) / (tokens - 1)) and e2e over all requests. "
              "`engine`: in-flight, mean engine step time and tokens per step (prefill included) from its /metrics; "
              "dynamic, size x count of the batches llm_dynamic's execute() received.", ""]
    if genai:
        lines += ["## genai-perf cross-check", "",
                  "genai-perf 0.0.16 (`--backend vllm`, synthetic prompts, its own token counting by re-tokenizing "
                  "the text), same server.", "",
                  "| arm | model | concurrency | requests | input tokens | output mean/stddev | tokens/s | requests/s "
                  "| TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | e2e p99 |",
                  "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for g in genai:
            s = g.get("stats")
            head = (f"| {g['arm']} | {g['model']} | {g['concurrency']} | {g['requests']} | {g['input_tokens']} | "
                    f"{g['output_mean']}/{g['output_stddev']} |")
            lines.append(head + (f" {_f(s.tokens_per_s)} | {_f(s.requests_per_s, 2)} | {_f(s.ttft_p50_ms, 0)} | "
                                 f"{_f(s.ttft_p99_ms, 0)} | {_f(s.itl_p50_ms)} | {_f(s.itl_p99_ms)} | "
                                 f"{_f(s.e2e_p99_ms, 0)} |"
                                 if s else f" failed: {g['error'].splitlines()[0]} | | | | | | |"))
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    path.write_text("\n".join(lines))
