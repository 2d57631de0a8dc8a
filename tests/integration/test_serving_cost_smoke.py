"""perf.bench.serving_cost end to end in --tiny (tiny-llama, a real tritonserver): the offline run and both served
arms complete every request, and the per-token breakdown names every part."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serving_cost_runs_offline_and_both_served_arms(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "-m", "perf.bench.serving_cost", "--tiny", "--json", str(out),
                           "--out", str(tmp_path / "README.md")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"].split(" ")[0] for r in runs] == ["offline", "served:", "served:"]
    for r in runs:
        assert r["errors"] == 0 and r["tokens_per_s"] > 0 and r["steps"] > 0
    assert set(runs[1]["cpu_ms_per_token"]) == {"engine thread", "stub, other threads", "tritonserver", "client"}
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"] == runs[2]["output_tokens"]  # the same load
    assert "served / offline" in (tmp_path / "README.md").read_text()
