"""perf/bench/structured.py at a handful of requests, so the benchmark cannot rot (it stopped at its first line
once the grammar cache changed): every step mode, constrained and not, the CPU named, JSON."""
from __future__ import annotations

import json
import subprocess
import sys

from engine_helpers import ROOT


def test_structured_bench_smoke(tmp_path):
    out = tmp_path / "structured.json"
    cmd = [sys.executable, "-m", "perf.bench.structured", "--running", "4", "--steps", "3", "--warmup", "1",
           "--skip-served", "--skip-model", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cpu"] and report["cpu_family_model"]
    steps = report["steps"]
    assert steps["constrained_rows"] == 2 and report["mask_ms_per_step"] == steps["greedy"]["mask_ms_per_step"]
    for mode in ("greedy", "sampled", "top_p"):
        assert steps[f"{mode}_unconstrained"]["checked_per_step"] == 0
        assert steps[f"{mode}_unconstrained"]["mask_ms"] < steps[f"{mode}_constrained"]["mask_ms"]
        assert steps[f"{mode}_constrained"]["running_at_end"] == 4
    # Greedy and temperature-only rows are checked after sampling; top-p rows are masked whole before it.
    assert steps["greedy_constrained"]["checked_per_step"] == 2 == steps["sampled_constrained"]["checked_per_step"]
    assert steps["top_p_constrained"]["checked_per_step"] == 0 and steps["top_p_constrained"]["mask_apply_ms"] > 0
    assert report["compile_ms_first"] > 0 and report["cached_ttft_added_ms"] > 0
