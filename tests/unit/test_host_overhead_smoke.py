"""perf/bench/host_overhead.py at a handful of requests, so the benchmark cannot rot: every mode and phase, JSON."""
from __future__ import annotations

import json
import subprocess
import sys

from engine_helpers import ROOT, TINY


def test_host_overhead_smoke(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, "-m", "perf.bench.host_overhead", "--model", TINY, "--running", "2,4",
           "--steps", "3", "--sampled-steps", "2", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["greedy_ms_per_step"] > 0 and report["sampled_ms_per_step"] > 0 and report["stop_ms_per_step"] > 0
    runs = {(r["mode"], r["running"]): r for r in report["results"]}
    assert set(runs) == {(mode, n) for mode in ("greedy", "sampled", "stop") for n in (2, 4)}
    for r in runs.values():
        phases = set(r["ms_per_step"])
        assert {"schedule", "prepare", "advance", "overlap", "sample", "detokenize", "other", "sampler_ops"} <= phases
        assert r["critical_ms"] <= r["total_ms"] and r["sampler_ops_per_step"] >= 1
    # Sampling with top-p, penalties and seeds runs more ops on the device than a greedy argmax.
    assert runs[("sampled", 4)]["sampler_ops_per_step"] > runs[("greedy", 4)]["sampler_ops_per_step"]
