"""perf/gpu/bench.py --smoke on CPU (tiny random Qwen2, Triton in the interpreter), so the GPU script cannot rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_helpers import ROOT


def test_gpu_bench_smoke_runs_and_reports(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("INFLIGHT_ATTENTION", None)
    cmd = [sys.executable, "-m", "perf.gpu.bench", "--smoke", "--out", str(tmp_path),
           "--hbm-bandwidth", "1e11"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [report_path] = tmp_path.glob("gpu_bench-*.json")
    assert (tmp_path / report_path.name.replace(".json", ".md")).exists()
    report = json.loads(report_path.read_text())
    run = report["throughput"]
    assert run["output_tokens"] == run["expected_output_tokens"] > 0 and not run["truncated_at_time_limit"]
    assert run["output_tokens_per_s"] > 0
    phases = {"schedule", "prepare", "forward", "overlap", "mask", "sample", "detokenize", "other"}
    for view in ("host_view", "device_view"):  # the breakdown is a separate run, timed both ways
        part = report["breakdown"][view]
        assert part["output_tokens"] > 0 and part["decode_steps"] > 0, view
        assert set(part["all_steps"]) == phases and part["full_batch_decode_count"] > 0, view
    assert report["breakdown"]["critical_path_ms"] > 0
    decode = report["roofline"]["all_decode_steps"]
    assert decode["steps"] > 0
    assert 0 < decode["fraction_of_step"] < decode["fraction_of_forward"]
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {"triton_vs_torch_attention", "static_decode_vs_eager"}
    assert all(c["greedy_equal"] and c["logits_ok"] for c in checks.values()), checks
    assert not report["errors"]
