"""The container probes' decisions (server_harness.serve_state), and scripts/health.py reading serve.py's state
file: ready only while serving with no dead stub; live unless serve.py is stuck, gave up, takes too long to
start, or leaves a dead stub alone past the grace."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from server_harness.serve_state import (FAILED, RESTARTING, SERVING, STARTING, ServeState, liveness, read_state,
                                        readiness, state_path, write_state)

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_000_000.0


def state(name: str = SERVING, since: float = NOW - 100, heartbeat: float = NOW - 1, **kw) -> ServeState:
    return ServeState(state=name, since=since, serve_pid=1, server_pid=2, heartbeat=heartbeat, **kw)


def test_ready_only_while_serving_with_triton_ready_and_no_dead_stub():
    assert readiness(state(), NOW, True, []).ok
    assert not readiness(None, NOW, True, []).ok
    assert "silent" in readiness(state(heartbeat=NOW - 60), NOW, True, []).why
    assert "restarting (stub llm_0_0 killed)" in readiness(state(RESTARTING, reason="stub llm_0_0 killed"), NOW,
                                                           True, []).why
    assert "dead stub: pid 7" in readiness(state(), NOW, True, ["pid 7: killed by signal 9 (SIGKILL)"]).why
    assert not readiness(state(), NOW, False, []).ok


def test_live_through_a_restart_within_budget_and_not_past_it():
    assert liveness(state(RESTARTING, since=NOW - 30), NOW, False, 30, 600).ok  # Triton down while restarting
    assert not liveness(state(RESTARTING, since=NOW - 700), NOW, False, 30, 600).ok
    assert not liveness(state(STARTING, since=NOW - 601), NOW, False, 30, 600).ok
    assert "gave up" in liveness(state(FAILED, reason="6 restarts"), NOW, True, 30, 600).why
    assert "silent" in liveness(state(heartbeat=NOW - 31), NOW, True, 30, 600).why


def test_a_dead_stub_left_alone_fails_liveness_after_the_grace():
    dead = [{"instance": "llm_0_0", "model": "llm", "pid": 7, "cause": "killed by signal 9 (SIGKILL)",
             "seen_at": NOW - 10}]
    assert liveness(state(dead_stubs=dead), NOW, True, 30, 600).ok
    verdict = liveness(state(dead_stubs=dead), NOW + 25, True, 30, 600)
    assert not verdict.ok and "llm_0_0 dead for 35 s (killed by signal 9 (SIGKILL))" in verdict.why
    assert not liveness(state(), NOW, False, 30, 600).ok  # serving, and Triton does not answer live


def test_state_file_round_trip_and_one_file_per_port(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVE_STATE_DIR", str(tmp_path))
    path = state_path(8123)
    assert path == tmp_path / "llm-serve-8123.json" and state_path(8124) != path
    write_state(path, state(restarts=2, reason="stub llm_0_1 killed by signal 9 (SIGKILL)"))
    back = read_state(path)
    assert back.restarts == 2 and back.state == SERVING and back.heartbeat > NOW
    path.write_text("{not json")
    assert read_state(path) is None


def test_health_script_answers_no_without_a_server_and_yes_from_the_state(tmp_path):
    env = {**os.environ, "SERVE_STATE_DIR": str(tmp_path), "HTTP_PORT": "1"}  # nothing listens on port 1

    def health(what: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "health.py"), what], env=env,
                              capture_output=True, text=True, timeout=30)

    missing = health("ready")
    assert missing.returncode == 1 and "no state from serve.py" in missing.stdout
    write_state(tmp_path / "llm-serve-1.json", ServeState(RESTARTING, since=0.0 + 1e12, serve_pid=os.getpid()))
    assert health("live").returncode == 0  # restarting within its budget: alive even though Triton is down
    ready = health("ready")
    assert ready.returncode == 1 and "serve.py is restarting" in ready.stdout
    assert health("bogus").returncode == 2
