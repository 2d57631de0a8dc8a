"""The short soak: `python -m perf.soak` for 30 s of mixed traffic on tiny-llama, end to end as a user runs it.
Every request gets exactly one final, no KV block leaks, the server's count of finished requests equals the
requests that reached it, and nothing is left behind."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip("models/tiny-llama missing: run `make setup`")
    proc = subprocess.run([sys.executable, "-m", "perf.soak", "--seconds", "30", "--tiny",
                           "--concurrency", "4", "--name", "short", "--results-dir", str(tmp_path), "--sample-s", "2"],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    out_dir = tmp_path / "soak-short"
    assert (out_dir / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out_dir / "summary.json").read_text())["summary"]
    assert s["requests"] > 50
    assert (s["missing_finals"], s["duplicate_finals"], s["failed_outcomes"]) == (0, 0, 0), s["finals_examples"] + \
        s["failed_examples"]
    assert s["leaked_blocks"] == 0 and s["quiescence_problems"] == [] and s["metrics_unreachable"] == []
    assert s["server_count_mismatch"] == 0 and s["engine_bound_requests"] > 0
    assert set(s["by_action"]) == {"stream", "nonstream", "http", "grpc_cancel", "stop_cancel", "http_drop", "bad"}
    assert s["leftovers"] == []
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (out_dir / "report.md").read_text()
    assert "PASSED" in report and "| KV blocks leaked at the end | 0 |" in report
    assert len((out_dir / "samples.csv").read_text().splitlines()) > 5
