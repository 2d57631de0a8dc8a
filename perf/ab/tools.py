"""The measuring tools, always bounded: perf_analyzer (by request count, under `timeout`), genai-perf, and
the server's /metrics for the batch sizes llm_dynamic's execute() received."""
from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

from perf.ab.metrics import CellStats

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
PERF_ANALYZER = VENV_BIN / "perf_analyzer"  # the wrapper scripts/setup.sh writes (libraries found)
GENAI_PERF = VENV_BIN / "genai-perf"


class ToolError(RuntimeError):
    """A tool failed or timed out; the message carries the command's exit status and output tail."""


class EmptyExport(ToolError):
    """perf_analyzer exited 0 after printing its results but left its profile export empty (seen once in
    CI with 2.51's client); the cell is worth one rerun."""


def _run(cmd: list[str], timeout_s: float, log_path: Path, env: dict[str, str] | None = None) -> None:
    # `timeout` as well as our own limit: perf_analyzer waits forever when the server dies.
    full = ["timeout", "--kill-after=10", str(int(timeout_s)), *cmd]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(full) + "\n")
        log.flush()
        done = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                              timeout=timeout_s + 30)
    if done.returncode != 0:
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-15:])
        why = "timed out" if done.returncode in (124, 137) else f"exit status {done.returncode}"
        raise ToolError(f"{Path(cmd[0]).name} {why} after at most {timeout_s:.0f} s (log {log_path}):\n{tail}")


def perf_analyzer(model: str, grpc_url: str, input_data: Path, concurrency: int, request_count: int,
                  export_path: Path, timeout_s: float) -> None:
    """Streaming gRPC, closed loop at `concurrency`, exactly `request_count` requests measured.

    One client thread: perf_analyzer splits --request-count evenly between its threads, and a thread that
    drew the long requests keeps working while the others stop, so with several threads concurrency
    drains long before the last request is sent. One async thread keeps every slot busy until then.
    (count_windows mode keeps concurrency, but its export drops every request that straddles a window
    boundary, which are mostly the long ones.)"""
    # perf_analyzer refuses an export path that exists (exit 99): a rerun after an empty export must clear it.
    export_path.unlink(missing_ok=True)
    _run([str(PERF_ANALYZER), "-m", model, "-i", "grpc", "--streaming", "-u", grpc_url,
          "--input-data", str(input_data), "--concurrency-range", str(concurrency),
          "--request-count", str(request_count), "--max-threads", "1",
          "--profile-export-file", str(export_path)],
         timeout_s, export_path.with_suffix(".log"))
    if not export_path.exists() or export_path.stat().st_size == 0:
        log_path = export_path.with_suffix(".log")
        raise EmptyExport(f"perf_analyzer exited 0 but left {export_path} empty (log {log_path})")


def genai_perf(model: str, grpc_url: str, tokenizer_dir: Path, concurrency: int, request_count: int,
               input_tokens: int, output_mean: int, output_stddev: int, artifact_dir: Path,
               timeout_s: float) -> CellStats:
    """genai-perf 0.0.16 on Triton (kserve, vllm-style inputs), synthetic prompts, ignore_eos. Its figures in
    our stats type; it reports no error count or window, so those are 0 and NaN."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    _run([str(GENAI_PERF), "profile", "-m", model, "--backend", "vllm", "--streaming", "-u", grpc_url,
          "--tokenizer", str(tokenizer_dir), "--synthetic-input-tokens-mean", str(input_tokens),
          "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(output_mean),
          "--output-tokens-stddev", str(output_stddev), "--extra-inputs", "ignore_eos:true",
          "--concurrency", str(concurrency), "--request-count", str(request_count),
          "--warmup-request-count", "0", "--random-seed", "0", "--artifact-dir", str(artifact_dir)],
         timeout_s, artifact_dir / "genai-perf.log",
         # It runs `perf_analyzer` from PATH, and must not reach for the hub for the tokenizer.
         env={"PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"})
    found = sorted(artifact_dir.rglob("profile_export_genai_perf.json"))
    if not found:
        raise ToolError(f"genai-perf wrote no profile_export_genai_perf.json under {artifact_dir}")
    m = json.loads(found[0].read_text())
    return CellStats(
        num_requests=request_count, num_errors=0,
        output_tokens=round(m["output_sequence_length"]["avg"] * request_count), window_s=float("nan"),
        tokens_per_s=m["output_token_throughput"]["avg"], requests_per_s=m["request_throughput"]["avg"],
        ttft_p50_ms=m["time_to_first_token"]["p50"], ttft_p99_ms=m["time_to_first_token"]["p99"],
        itl_p50_ms=m["inter_token_latency"]["p50"], itl_p99_ms=m["inter_token_latency"]["p99"],
        e2e_p50_ms=m["request_latency"]["p50"], e2e_p99_ms=m["request_latency"]["p99"])


_BATCH_LINE = re.compile(r'^llm_dynamic_batches_total\{[^}]*batch_size="(\d+)"[^}]*\}\s+([0-9.e+]+)$')


def dynamic_batch_counts(metrics_url: str) -> dict[int, int]:
    """batch size -> how many batches llm_dynamic's execute() has received so far."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    counts: dict[int, int] = {}
    for line in text.splitlines():
        match = _BATCH_LINE.match(line)
        if match:
            counts[int(match.group(1))] = counts.get(int(match.group(1)), 0) + int(float(match.group(2)))
    return counts


def batch_delta(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    return {size: after[size] - before.get(size, 0) for size in after if after[size] > before.get(size, 0)}


_ENGINE_SERIES = {"step_s": "inflight:step_time_seconds", "tokens": "vllm:iteration_tokens_total",
                  "queue": "vllm:request_queue_time_seconds"}
_LE = re.compile(r'le="([^"]+)"')


def inflight_step_totals(metrics_url: str, model: str = "llm") -> dict[str, float]:
    """An engine's cumulative step count, step seconds and tokens per step (its histograms' _count and _sum), and
    its queue-time histogram (arrival at the engine's model -> first scheduled step: queue_count, queue_s and one
    `queue_le_<bound>` cumulative count per bucket); differences over a run give its mean step time, batch fill
    and queue times."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    totals = {"steps": 0.0, "step_s": 0.0, "tokens": 0.0, "queue_count": 0.0, "queue_s": 0.0}
    for line in text.splitlines():
        if f'model="{model}"' not in line:
            continue
        name, value = line.partition("{")[0], line.rsplit(" ", 1)[-1]
        if name == _ENGINE_SERIES["step_s"] + "_count":
            totals["steps"] += float(value)
        elif name == _ENGINE_SERIES["step_s"] + "_sum":
            totals["step_s"] += float(value)
        elif name == _ENGINE_SERIES["tokens"] + "_sum":
            totals["tokens"] += float(value)
        elif name == _ENGINE_SERIES["queue"] + "_count":
            totals["queue_count"] += float(value)
        elif name == _ENGINE_SERIES["queue"] + "_sum":
            totals["queue_s"] += float(value)
        elif name == _ENGINE_SERIES["queue"] + "_bucket":
            key = "queue_le_" + _LE.search(line).group(1)
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def histogram_quantile(totals: dict[str, float], prefix: str, q: float) -> float:
    """The upper bound of the bucket that holds the q-quantile (0..1) of a histogram given as cumulative
    `<prefix><bound>` counts (a run's deltas): all a histogram can say for sure (interpolating inside the queue
    histogram's 100 -> 300 ms bucket would invent figures); inf past the last bound, NaN without observations."""
    bounds = sorted((float(k[len(prefix):]), v) for k, v in totals.items() if k.startswith(prefix))
    if not bounds or bounds[-1][1] <= 0:
        return float("nan")
    rank = q * bounds[-1][1]
    return next(bound for bound, count in bounds if count >= rank)


def triton_queue_totals(http_base: str, model: str) -> tuple[float, float]:
    """Triton's own statistics for a model: (executions counted in its queue statistic, their queue seconds). For
    llm_iterative that is per iteration: the wait between a reschedule and the next execute."""
    with urllib.request.urlopen(f"{http_base}/v2/models/{model}/stats", timeout=10) as resp:
        stats = json.loads(resp.read().decode())
    count = ns = 0.0
    for entry in stats.get("model_stats", []):
        queue = entry.get("inference_stats", {}).get("queue", {})
        count += float(queue.get("count", 0))
        ns += float(queue.get("ns", 0))
    return count, ns / 1e9
