"""The A/B harness reruns a cell once when perf_analyzer exits 0 but leaves its profile export empty (seen in
CI with 2.51's client), and counts only the run it read. perf_analyzer is stood in for by a script, since the
empty export cannot be provoked from the real one; the server's /metrics by fixed counters."""
from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

from perf.ab import harness as ab_harness
from perf.ab import tools as ab_tools
from perf.ab import workloads as ab_workloads

EXPORT = {"experiments": [{"requests": [
    {"timestamp": 0, "response_timestamps": [1_000_000, 2_000_000],
     "response_outputs": [{"num_output_tokens": 1}, {"num_output_tokens": 1}]}]}]}


def fake_perf_analyzer(tmp_path: Path, empty_runs: int) -> Path:
    """Writes an empty export on its first `empty_runs` runs, a one-request export after; counts its runs.
    Like the real one (2.51), it refuses an export path that already exists, with exit status 99."""
    script = tmp_path / "perf_analyzer"
    good = tmp_path / "good.json"
    good.write_text(json.dumps(EXPORT))
    script.write_text(f"""#!/bin/sh
n=$(cat {tmp_path}/runs 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {tmp_path}/runs
while [ "$1" != "--profile-export-file" ]; do shift; done
if [ -e "$2" ]; then echo "Error: Failed to parse --profile-export-file. Path must not already exist."; exit 99; fi
if [ $n -le {empty_runs} ]; then : > "$2"; else cp {good} "$2"; fi
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def run_one_pair(tmp_path: Path, monkeypatch, empty_runs: int):
    monkeypatch.setattr(ab_tools, "PERF_ANALYZER", fake_perf_analyzer(tmp_path, empty_runs))
    monkeypatch.setattr(ab_tools, "dynamic_batch_counts", lambda url: {})
    monkeypatch.setattr(ab_tools, "batch_delta", lambda before, after: {4: 1})
    scrapes = iter(range(1, 100))  # the in-flight step counter grows by one per scrape
    monkeypatch.setattr(ab_tools, "inflight_step_totals", lambda url, model: {"steps": float(next(scrapes))})
    monkeypatch.setattr(ab_tools, "triton_queue_totals", lambda url, model: (0.0, 0.0))
    monkeypatch.setattr(ab_harness.time, "sleep", lambda s: None)
    workload = ab_workloads.Workload("w", "", [ab_workloads.Request("hi", 2)], 1, 0)
    server = SimpleNamespace(metrics_url="unused", grpc_url="unused", http_base="unused")
    # first=0: round 0 runs the arms in the order given, in-flight first
    cells = ab_harness.run_pair(server, workload, 1, 1, 1, 0, tmp_path, 60, ("inflight", "dynamic"), "perf_analyzer")
    return cells, int((tmp_path / "runs").read_text())


def test_an_empty_export_is_rerun_once_and_only_the_read_run_counts(tmp_path, monkeypatch):
    cells, runs = run_one_pair(tmp_path, monkeypatch, empty_runs=1)
    assert runs == 3  # in-flight twice, dynamic once
    inflight = cells["inflight"]
    assert not inflight.error and inflight.stats.output_tokens == 2
    assert inflight.steps == {"steps": 1.0}  # the read run's scrapes (2 -> 3), not from the empty run's (1 -> 3)
    assert not cells["dynamic"].error and cells["dynamic"].batches == {4: 1}


def test_a_second_empty_export_fails_the_cell_with_the_reason(tmp_path, monkeypatch):
    cells, runs = run_one_pair(tmp_path, monkeypatch, empty_runs=2)
    assert runs == 3  # in-flight twice (both empty: it fails), dynamic once (read)
    assert "left" in cells["inflight"].error and "empty" in cells["inflight"].error
    assert cells["inflight"].stats is None and cells["dynamic"].stats is not None
