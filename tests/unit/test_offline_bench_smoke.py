"""perf/bench/offline.py on the tiny model, so the issue-2 benchmark cannot rot between real runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_helpers import ROOT

TINY = os.path.join(ROOT, "models", "tiny-llama")


@pytest.mark.skipif(not os.path.exists(os.path.join(TINY, "config.json")), reason="models/tiny-llama missing")
def test_offline_bench_runs_both_sides_and_reports(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "perf.bench.offline", "--model", TINY, "--num-requests", "8",
           "--batch", "4", "--scale", "0.05", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    engine, hf = result["engine"], result["hf_static"]
    # The mix x 0.05 is 1/2/10/40 tokens over 8 requests: both sides must count exactly those.
    assert engine["tokens"] == hf["tokens"] == 2 * (1 + 2 + 10 + 40)
    assert engine["steps"] > 0 and result["throughput_ratio"] > 0 and result["single_stream_ratio"] > 0
    phases = engine["wall_ms_per_step_by_phase"]
    assert set(phases) == {"schedule", "prepare", "forward", "overlap", "mask", "sample", "detokenize", "other"}
    assert phases["forward"] > 0
    assert result["workload"]["engine_cpu_gemm"] in ("onednn", "blas")
    assert "| mixed workload tokens/s |" in proc.stdout
