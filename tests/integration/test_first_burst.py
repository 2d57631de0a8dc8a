"""The first burst after `make serve` says ready is served as fast as a later one: nothing the server still does
after its ready line takes the cores the requests need (the OpenAI frontend's start-up took one core for ~6 s after
it, and 16 streams waited 5.3 s for their first token instead of 0.53 s; AMD EPYC Zen 3, family 25 model 1)."""
from __future__ import annotations

import os
import time

import pytest

from engine_helpers import MODEL_REPOSITORY
from serve_script import serve_script
from server_harness.server import free_ports
from server_harness.stream_client import StreamClient

pytestmark = pytest.mark.timeout(600)
NUM_STREAMS = 16


def burst(grpc_url: str, tag: str) -> float:
    """The longest time to first token of NUM_STREAMS streams sent at once, one gRPC stream each."""
    clients = [StreamClient(grpc_url) for _ in range(NUM_STREAMS)]
    try:
        for i, client in enumerate(clients):
            client.send("llm", f"{tag}{i}", "Why is the sky blue?", {"max_tokens": 16, "stream": True,
                                                                     "ignore_eos": True})
        for client in clients:
            assert client.wait_finals(120)
        records = [r for client in clients for r in client.records.values()]
        assert all(r.error is None for r in records), [r.error for r in records]
        return max(r.first_response_at - r.sent_at for r in records)
    finally:
        for client in clients:
            client.close()


def test_the_first_burst_after_ready_is_as_fast_as_a_warm_one(tmp_path):
    http, grpc, metrics, oai = free_ports(4)
    env = {**os.environ, "MODEL_REPOSITORY": str(MODEL_REPOSITORY), "HTTP_PORT": str(http),
           "GRPC_PORT": str(grpc), "METRICS_PORT": str(metrics), "OPENAI_PORT": str(oai), "EXIT_TIMEOUT_SECS": "5"}
    with serve_script(env, tmp_path / "serve.log", "tritonserver is ready", timeout_s=300):
        first = burst(f"127.0.0.1:{grpc}", "first")
        time.sleep(3)
        warm = min(burst(f"127.0.0.1:{grpc}", f"warm{i}") for i in range(2))
    print(f"max time to first token of {NUM_STREAMS} streams: first burst {first:.2f} s, warm {warm:.2f} s")
    assert first <= 2 * warm + 0.2, f"the first burst waited {first:.2f} s for a first token, a warm one {warm:.2f} s"
