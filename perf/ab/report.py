"""The A/B/C report: Markdown (per arm per concurrency, ratios against ours and the theoretical ceiling), CSV, PNG
plots. Arms: inflight (ours, `llm`), iterative (Triton's iterative sequence batcher, `llm_iterative`), dynamic
(Triton's dynamic batcher, `llm_ensemble`), and any ablation of ours (`inflight-no-...`)."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from perf.ab.metrics import CellStats
from perf.ab.tools import histogram_quantile

ARMS = ("inflight", "iterative", "dynamic")  # the batchers, in the order reports list them
BASELINE = "inflight"  # ratios are ours over each other arm


@dataclass
class Cell:
    workload: str
    concurrency: int
    arm: str  # "inflight", "iterative", "dynamic" or an ablation of ours ("inflight-no-...")
    model: str
    stats: CellStats | None = None
    error: str = ""
    batches: dict[int, int] = field(default_factory=dict)  # dynamic arm: batch size -> count
    # The arm's engine over the run (deltas of its /metrics): steps, step seconds, tokens, queue-time histogram.
    steps: dict[str, float] = field(default_factory=dict)
    triton_queue: tuple[float, float] = (0.0, 0.0)  # Triton's queue statistic of the engine model: (count, seconds)
    # Read back from a results.csv (the histogram buckets are not kept there).
    saved: dict[str, float] = field(default_factory=dict)

    @property
    def step_summary(self) -> str:
        n = self.steps.get("steps", 0)
        if not n:
            return ""
        return f"{1e3 * self.steps['step_s'] / n:.0f} ms/step, {self.steps['tokens'] / n:.1f} tok/step"

    @property
    def queue_mean_ms(self) -> float:
        """Arrival at the engine's model -> first engine step, mean (the engine's own histogram)."""
        if "queue_mean_ms" in self.saved:
            return self.saved["queue_mean_ms"]
        n = self.steps.get("queue_count", 0)
        return 1e3 * self.steps.get("queue_s", 0.0) / n if n else float("nan")

    @property
    def queue_p99_ms(self) -> float:
        if "queue_p99_ms" in self.saved:
            return self.saved["queue_p99_ms"]
        return 1e3 * histogram_quantile(self.steps, "queue_le_", 0.99)

    @property
    def triton_queue_ms(self) -> float:
        """Triton's queue time per execution of the engine model (iterative: per step of a request)."""
        if "triton_queue_ms" in self.saved:
            return self.saved["triton_queue_ms"]
        count, seconds = self.triton_queue
        return 1e3 * seconds / count if count else float("nan")

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


def ratios(cells: list[Cell]) -> dict[tuple[str, int, str], dict[str, float]]:
    """(workload, concurrency, other arm) -> ours over it: throughput ratios (ours / theirs) and latency ratios
    (theirs / ours: how many times lower ours is)."""
    by = {(c.workload, c.concurrency, c.arm): c.stats for c in cells if c.stats is not None}
    out = {}
    for (w, n, arm), o in by.items():
        s = by.get((w, n, BASELINE))
        if arm == BASELINE or s is None:
            continue
        out[(w, n, arm)] = {
            "tokens": s.tokens_per_s / o.tokens_per_s, "requests": s.requests_per_s / o.requests_per_s,
            "ttft_p99": o.ttft_p99_ms / s.ttft_p99_ms, "ttft_p50": o.ttft_p50_ms / s.ttft_p50_ms,
            "e2e_p99": o.e2e_p99_ms / s.e2e_p99_ms}
    return out


def _arm_order(arm: str) -> tuple[int, str]:
    return (ARMS.index(arm) if arm in ARMS else len(ARMS), arm)


EXTRA_COLUMNS = ("queue_mean_ms", "queue_p99_ms", "triton_queue_ms", "ms_per_step", "tokens_per_step")


def _extras(c: Cell) -> list[str]:
    n = c.steps.get("steps", 0)
    per_step = [1e3 * c.steps["step_s"] / n, c.steps["tokens"] / n] if n else [float("nan")] * 2
    if not n and c.saved:
        per_step = [c.saved.get("ms_per_step", float("nan")), c.saved.get("tokens_per_step", float("nan"))]
    return [f"{x:.3f}" if not math.isnan(x) else "" for x in
            (c.queue_mean_ms, c.queue_p99_ms, c.triton_queue_ms, *per_step)]


def write_csv(cells: list[Cell], workloads: dict[str, WorkloadInfo], path: Path) -> None:
    names = CellStats.names()
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["workload", "concurrency", "arm", "model", *names, "mean_batch_size", "ceiling",
                         *EXTRA_COLUMNS, "error"])
        for c in cells:
            values = [getattr(c.stats, n) for n in names] if c.stats else [""] * len(names)
            writer.writerow([c.workload, c.concurrency, c.arm, c.model, *values,
                             _f(c.mean_batch, 2) if c.arm == "dynamic" else "", f"{workloads[c.workload].ceiling:.3f}",
                             *(_extras(c) if c.stats else [""] * len(EXTRA_COLUMNS)),
                             c.error.splitlines()[0] if c.error else ""])


def read_csv(path: Path) -> list[Cell]:
    """The cells of a results.csv (what plot() and the report need), to redraw an earlier run's plots; files
    written before the extra columns existed read back without them."""
    cells = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            stats = None
            if row["tokens_per_s"]:
                stats = CellStats(**{n: (int if n.startswith("num_") or n == "output_tokens" else float)(row[n])
                                     for n in CellStats.names()})
            saved = {k: float(row[k]) for k in EXTRA_COLUMNS if row.get(k)}
            cells.append(Cell(row["workload"], int(row["concurrency"]), row["arm"], row["model"], stats, row["error"],
                              saved=saved))
    return cells


_STYLE = {"inflight": ("tab:blue", "o", "in-flight, ours (llm)"),
          "iterative": ("tab:green", "^", "iterative, Triton's (llm_iterative)"),
          "dynamic": ("tab:orange", "s", "dynamic, Triton's (llm_ensemble)")}
_ABLATION_COLORS = ("tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def _style(arm: str, arms: list[str]) -> tuple[str, str, str]:
    if arm in _STYLE:
        return _STYLE[arm]
    extra = [a for a in arms if a not in _STYLE]
    return _ABLATION_COLORS[extra.index(arm) % len(_ABLATION_COLORS)], "x", arm


def _arms(cells: list[Cell]) -> list[str]:
    return sorted({c.arm for c in cells}, key=_arm_order)
_LATENCIES = [("ttft", "TTFT (ms)"), ("itl", "inter-token latency (ms)"), ("e2e", "end-to-end latency (ms)")]


def _series(cells: list[Cell], workload: str, arm: str, attr: str) -> tuple[list[int], list[float]]:
    pts = sorted((c.concurrency, getattr(c.stats, attr)) for c in cells
                 if c.workload == workload and c.arm == arm and c.stats)
    return [p[0] for p in pts], [p[1] for p in pts]


def _draw_throughput(ax, cells: list[Cell], w: str, _col: int) -> None:
    arms = _arms(cells)
    for arm in arms:
        color, marker, label = _style(arm, arms)
        ax.plot(*_series(cells, w, arm, "tokens_per_s"), color=color, marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set(title=w, xlabel="concurrency", ylabel="output tokens/s")


def _draw_latency(ax, cells: list[Cell], w: str, col: int) -> None:
    metric, title = _LATENCIES[col]
    arms = _arms(cells)
    for arm in arms:
        color, marker, label = _style(arm, arms)
        for q, ls, face in (("p50", "--", "none"), ("p99", "-", color)):  # hollow markers for p50
            ax.plot(*_series(cells, w, arm, f"{metric}_{q}_ms"), color=color, marker=marker, linestyle=ls,
                    markerfacecolor=face, label=f"{label} {q}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{w}: {title}", fontsize=9)
    ax.set_xlabel("concurrency")


def _draw_tradeoff(ax, cells: list[Cell], w: str, _col: int) -> None:
    arms = _arms(cells)
    for arm in arms:
        color, marker, label = _style(arm, arms)
        pts = sorted((c.stats.tokens_per_s, c.stats.ttft_p99_ms, c.concurrency) for c in cells
                     if c.workload == w and c.arm == arm and c.stats)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=label)
        for x, y, n in pts:
            ax.annotate(str(n), (x, y), fontsize=7, textcoords="offset points", xytext=(3, 3))
    ax.set_yscale("log")
    ax.set_xlim(left=0)
    ax.set_title(f"{w}: p99 TTFT vs throughput", fontsize=9)
    ax.set(xlabel="output tokens/s", ylabel="p99 TTFT (ms)")


def _draw_queue(ax, cells: list[Cell], w: str, _col: int) -> None:
    arms = _arms(cells)
    for arm in arms:
        color, marker, label = _style(arm, arms)
        pts = sorted((c.concurrency, c.queue_mean_ms) for c in cells if c.workload == w and c.arm == arm and c.stats)
        pts = [p for p in pts if not math.isnan(p[1])]
        ax.plot([p[0] for p in pts], [max(p[1], 0.01) for p in pts], color=color, marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{w}: queue time, mean (server)", fontsize=9)
    ax.set(xlabel="concurrency", ylabel="arrival at the engine model -> first step (ms)")


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
        ("queue_time.png", False, n, (4.2 * n, 3.6), _draw_queue),
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


ARM_TEXT = {
    "inflight": "**inflight** = `llm`, ours: decoupled, one engine loop inside the model; every step our scheduler "
                "decides who runs (token budget, chunked prefill, prefix cache, fast lane, priorities)",
    "iterative": "**iterative** = `llm_iterative`, Triton's continuous batching: `sequence_batching { "
                 "iterative_sequence: true }`; Triton's sequence batcher hands each execute its requests (one slot "
                 "each, up to max_batch_size), execute() runs one step of the same engine over exactly them and "
                 "reschedules the unfinished",
    "dynamic": "**dynamic** = `llm_ensemble` (preprocessing -> `llm_dynamic` -> postprocessing): Triton's dynamic "
               "batcher forms a batch, execute() runs it as one static batch to completion on the same engine",
}


ABLATION_TEXT = {
    "inflight-no-chunked": "ours without chunked prefill (`enable_chunked_prefill=false`; the step budget then must "
                           "hold a whole prompt: `max_num_batched_tokens=2048`)",
    "inflight-no-prefix": "ours without the prefix cache (`enable_prefix_caching=false`)",
    "inflight-no-fastlane": "ours without the fast lane (no request counts as short: `fast_lane_max_prompt_tokens=0`, "
                            "`fast_lane_max_tokens=0`)",
    "iterative-plain": "Triton's iterative batcher around a plain step: each handed request's whole next iteration "
                       "(no chunked prefill, budget 2048) and no prefix cache: what a Triton user's own iterative "
                       "model has without our engine",
}


def _describe_arms(arms: list[str], meta: dict) -> list[str]:
    lines = ["Arms (one server, the same model, engine code and KV budget; greedy, `ignore_eos` so output lengths "
             "are exact):", ""]
    lines += [f"- {ARM_TEXT.get(a, f'**{a}** = {ABLATION_TEXT.get(a, a)}')}" for a in arms]
    return lines + ["", f"Load: {meta.get('load', 'perf_analyzer')}.", ""]


def write_markdown(cells: list[Cell], workloads: dict[str, WorkloadInfo], genai: list[dict], meta: dict,
                   plots: list[str], path: Path) -> None:
    arms = _arms(cells)
    others = [a for a in arms if a != BASELINE]
    lines = [f"# A/B/C: our in-flight batching vs Triton's batchers — {meta['name']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "name"]
    lines += [""] + _describe_arms(arms, meta)
    lines += ["## Ratios (ours over each other arm)", "",
              "Throughput ratio = ours tokens/s / theirs; TTFT and e2e ratios = theirs / ours (how many times lower "
              "ours is; below 1: theirs is lower). Ceiling = max output length / mean output length of the workload: "
              "what continuous batching can gain at most over static batches of that mix.", "",
              "| workload | concurrency | vs arm | tokens/s ratio | requests/s ratio | p99 TTFT ratio | "
              "p50 TTFT ratio | p99 e2e ratio | ceiling | mean dynamic batch |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    dyn = {(c.workload, c.concurrency): c for c in cells if c.arm == "dynamic"}
    order = list(workloads)
    for (w, n, arm), r in sorted(ratios(cells).items(),
                                 key=lambda kv: (order.index(kv[0][0]), kv[0][1], _arm_order(kv[0][2]))):
        batch = _f(dyn[(w, n)].mean_batch, 1) if arm == "dynamic" and (w, n) in dyn else ""
        lines.append(f"| {w} | {n} | {arm} | {_f(r['tokens'], 2)}x | {_f(r['requests'], 2)}x | "
                     f"{_f(r['ttft_p99'], 2)}x | {_f(r['ttft_p50'], 2)}x | {_f(r['e2e_p99'], 2)}x | "
                     f"{_f(workloads[w].ceiling, 2)} | {batch} |")
    if not others:
        lines.append("(one arm only)")
    lines += ["", "## Per arm, per concurrency", ""]
    for w, info in workloads.items():
        lengths = sorted(set(info.output_lengths))
        lines += [f"### {w}: {info.description}", "",
                  f"Prompt ~{info.prompt_tokens} tokens" + (f" after a shared prefix of ~{info.prefix_tokens}"
                                                             if info.prefix_tokens else "")
                  + f"; output lengths {lengths}; ceiling {info.ceiling:.2f}.", "",
                  "| concurrency | arm | requests | errors | tokens/s | requests/s | TTFT p50 | TTFT p99 | "
                  "ITL p50 | ITL p99 | e2e p50 | e2e p99 | queue mean | queue p99 <= | Triton queue | engine |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for c in sorted((c for c in cells if c.workload == w), key=lambda c: (c.concurrency, _arm_order(c.arm))):
            if c.stats is None:
                lines.append(f"| {c.concurrency} | {c.arm} | failed: {c.error.splitlines()[0] if c.error else '?'} "
                             "| | | | | | | | | | | | | |")
                continue
            s = c.stats
            seen = (", ".join(f"{k}x{v}" for k, v in sorted(c.batches.items())) if c.arm == "dynamic"
                    else c.step_summary)
            lines.append(f"| {c.concurrency} | {c.arm} | {s.num_requests} | {s.num_errors} | {_f(s.tokens_per_s)} | "
                         f"{_f(s.requests_per_s, 2)} | {_f(s.ttft_p50_ms, 0)} | {_f(s.ttft_p99_ms, 0)} | "
                         f"{_f(s.itl_p50_ms)} | {_f(s.itl_p99_ms)} | {_f(s.e2e_p50_ms, 0)} | "
                         f"{_f(s.e2e_p99_ms, 0)} | {_f(c.queue_mean_ms, 1)} | {_f(c.queue_p99_ms, 0)} | "
                         f"{_f(c.triton_queue_ms, 2)} | {seen} |")
        lines.append("")
    lines += ["Latencies in ms. Throughput over the steady window (first to last request sent, every client busy); "
              "TTFT, ITL (per request: (last - first token time) / (tokens - 1)) and e2e over all requests, as the "
              "client saw them. Queue mean / p99: the engine's `vllm:request_queue_time_seconds` over the run "
              "(arrival at the engine's model -> its first engine step; p99: the upper bound of its bucket). "
              "For `iterative` the engine first sees a request when Triton hands it in, so Triton's own wait before "
              "that (for the step in progress, or for a slot) is not in it; Triton queue: Triton's queue statistic of "
              "the engine model per execution (`iterative`: per step of a request, the reschedule -> next execute "
              "gap; `dynamic`: the dynamic batcher's delay per request). `engine`: mean step time and tokens per "
              "step (prefill included) from the engine's /metrics; dynamic: size x count of the batches "
              "llm_dynamic's execute() received.", ""]
    if genai:
        lines += ["## genai-perf cross-check", "",
                  "genai-perf 0.0.16 (`--backend vllm`, synthetic prompts, its own token counting by re-tokenizing "
                  "the text), same server. It runs perf_analyzer, which cannot drive the iterative arm (it sends its "
                  "own sequence ids to any sequence-batched model), so that arm has no row here.", "",
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
