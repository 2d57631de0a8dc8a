"""scripts/drain.py, the Kubernetes preStop hook (docker/k8s/deployment.yaml): it returns only once the server
has nothing queued or running, so the SIGTERM that follows cancels nobody."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import fault_hooks
from server_harness.repository import make_model_repository
from server_harness.stream_client import StreamClient

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
DRAIN = ROOT / "scripts" / "drain.py"


def drain(srv, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRAIN), "--url", srv.metrics_url, "--settle-s", "0",
                           "--interval-s", "0.3", *extra], capture_output=True, text=True, timeout=120)


def test_drain_waits_for_the_request_in_flight_then_returns(triton_server_factory, tmp_path):
    params = {"model": str(TINY), **fault_hooks.ON, "metrics_interval_ms": "100"}
    repo = make_model_repository(ROOT / "model_repository", tmp_path / "repo", {"llm": params},
                                 files=[fault_hooks.FILE])
    srv = triton_server_factory(repo)
    t0 = time.monotonic()
    assert drain(srv).returncode == 0 and time.monotonic() - t0 < 10  # idle: at once

    client = StreamClient(srv.grpc_url)
    try:
        # 20 engine steps of 150 ms each: the request runs for about 3 s.
        client.send("llm", "slow", "Take your time.", {"max_tokens": 20, "ignore_eos": True, "stream": True,
                                                        "return_num_output_tokens": True},
                    {"inject_fault": "slow:ms=150,steps=20"})
        assert client.wait_responses("slow", 1, timeout_s=30)
        done = drain(srv, "--timeout-s", "60")
        finished_at = client.records["slow"].final_at  # read at once: None would mean drain did not wait
        assert done.returncode == 0 and "idle" in done.stdout, done.stdout + done.stderr
        assert finished_at is not None, "drain returned before the request's final"
        assert client.records["slow"].error is None and client.records["slow"].num_output_tokens == 20

        client.send("llm", "slow2", "Again.", {"max_tokens": 20, "ignore_eos": True, "stream": True},
                    {"inject_fault": "slow:ms=300,steps=20"})
        assert client.wait_responses("slow2", 1, timeout_s=30)
        short = drain(srv, "--timeout-s", "1")
        assert short.returncode == 1 and "still busy" in short.stdout, short.stdout
        assert client.wait_finals(60)
    finally:
        client.close()
