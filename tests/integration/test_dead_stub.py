"""A python-backend stub killed with SIGKILL under load, as `make serve` (scripts/serve.py) serves: no client hangs,
readiness says no until the server serves again, and without serve.py's restart the liveness probe fails.
End to end through `python -m perf.faults.dead_stub --tiny` (real tritonserver, both arms, two instances of each
engine, three streaming clients per arm), as a user runs it; every wait in it has a deadline, and so has this test.

What Triton 2.51 does on its own (docs/faults.md): it keeps the model ready, never restarts the stub, never answers
the requests in flight on a dead stub (neither arm's execute waits on its requests any more), and answers new
requests routed to the dead instance with "Stub process '...' is not healthy"; serve.py's restart closes the
streams of the requests in flight.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(420)


def dead_stub(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    if not (ROOT / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip("models/tiny-llama missing: run `make setup`")
    proc = subprocess.run([sys.executable, "-m", "perf.faults.dead_stub", "--tiny", "--results-dir", str(tmp_path),
                           "--name", "t", *args], capture_output=True, text=True, timeout=400, cwd=ROOT)
    path = tmp_path / "faults-dead-stub-t" / "summary.json"
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(path.read_text())


def test_a_dead_llm_stub_hangs_no_client_and_the_server_serves_again(tmp_path):
    proc, s = dead_stub(tmp_path, "--victim", "llm", "--deadline-s", "60")
    assert s["in_flight_at_kill"] >= 6, s  # three per arm at least
    assert s["hangs"] == 0 and s["more_than_one_final"] == 0, s
    llm = s["in_flight_outcomes"]["llm"]
    # Those on the dead instance: their stream closes when serve.py restarts the server (Triton 2.51 holds their
    # response factories only in the dead process); those on the other instance: a final (finished, or cancelled
    # by the restart). The dynamic arm did not lose its stub: its requests finish or are cancelled by the restart.
    assert set(llm) <= {"finished", "error final", "stream closed"} and sum(llm.values()) >= 3, s
    assert s["probe_not_ready_after_s"] is not None and s["probe_not_ready_after_s"] < 2.0, s
    assert s["serving_again_after_s"] is not None and s["serving_again_after_s"] > s["probe_not_ready_after_s"]
    assert s["first_requests_after"] == {"llm": "ok", "llm_ensemble": "ok"}, s
    assert any("stub llm_0_0" in line and "killed by signal 9 (SIGKILL)" in line for line in s["serve_log_lines"]), s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_dead_llm_dynamic_stub_hangs_no_client_and_the_server_serves_again(tmp_path):
    proc, s = dead_stub(tmp_path, "--victim", "llm_dynamic", "--deadline-s", "60")
    assert s["hangs"] == 0 and s["more_than_one_final"] == 0, s
    ens = s["in_flight_outcomes"]["llm_ensemble"]
    assert set(ens) <= {"finished", "error final", "stream closed"} and sum(ens.values()) >= 3, s
    assert s["probe_not_ready_after_s"] is not None and s["probe_not_ready_after_s"] < 2.0, s
    assert s["serving_again_after_s"] is not None, s
    assert s["first_requests_after"] == {"llm": "ok", "llm_ensemble": "ok"}, s
    assert any("stub llm_dynamic_0_0" in line and "killed by signal 9 (SIGKILL)" in line
               for line in s["serve_log_lines"]), s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_left_alone_a_dead_stub_stays_ready_in_triton_and_fails_the_liveness_probe(tmp_path):
    proc, s = dead_stub(tmp_path, "--victim", "llm", "--no-restart", "--observe-s", "15", "--deadline-s", "25",
                        "--dead-stub-grace-s", "5")
    assert s["triton_model_ready_while_dead_s"] >= 10, s  # Triton 2.51 still calls the model ready
    assert s["triton_not_ready_after_s"] is None, s
    assert s["probe_not_ready_after_s"] is not None and s["probe_not_ready_after_s"] < 2.0, s
    assert s["probe_not_live_after_s"] is not None and 5.0 <= s["probe_not_live_after_s"] < 8.0, s
    # The requests in flight on the dead stub never get an answer from Triton (what the restart is for).
    assert s["hangs"] >= 1, s
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
