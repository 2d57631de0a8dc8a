"""Both batching arms in one real tritonserver (tiny-llama, loopback, free ports): the dynamic arm (through
the ensemble) answers exactly like the in-flight arm, Triton really batches, the config swap works, and the
A/B harness runs end to end in --tiny."""
from __future__ import annotations

import csv
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from dynamic_arm.cancel_relay import CancelRelay
from engine_helpers import MODEL_REPOSITORY
from grpc_helpers import stream_to_final
from server_harness.repository import build_repository
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient

ROOT = Path(__file__).resolve().parents[2]

TINY = ROOT / "models" / "tiny-llama"
PROMPTS = ["The capital of France is", "Café au lait, naïve résumé: ☕ ", "1, 2, 3, 4,", "Why is the sky blue?"]
_DTYPES = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}


def _inputs(prompt: str, **values) -> list:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [text]
    for name, value in values.items():
        kind, dtype = _DTYPES[type(value)]
        tensor = grpcclient.InferInput(name, [1], kind)
        tensor.set_data_from_numpy(np.array([value], dtype=dtype))
        inputs.append(tensor)
    return inputs


def generate(url: str, model: str, prompt: str, **values) -> tuple[list[dict], str | None]:
    """Every response of one streaming request and the error, if any (exactly one final, nothing after it)."""
    return stream_to_final(url, model, _inputs(prompt, **values))


def text_of(responses: list[dict]) -> str:
    return b"".join(r["text_output"][0] for r in responses).decode("utf-8")


def batch_sizes(metrics_url: str) -> dict[int, int]:
    sizes = {}
    for line in urllib.request.urlopen(metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith("llm_dynamic_batches_total{"):
            size = int(line.split('batch_size="')[1].split('"')[0])
            sizes[size] = sizes.get(size, 0) + int(float(line.rsplit(" ", 1)[1]))
    return sizes


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    # A long queue delay makes concurrent requests land in one batch even on a loaded machine.
    return build_repository(MODEL_REPOSITORY, tmp_path_factory.mktemp("ab") / "model_repository",
                            {"model": str(TINY), "kv_cache_memory_bytes": str(16 << 20)},
                            max_batch_size=8, max_queue_delay_us=300_000)


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    srv = TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log", env={"OMP_NUM_THREADS": "1"})
    with srv:
        yield srv
    assert srv.leftovers() == []


@pytest.mark.parametrize("stream", [True, False])
def test_greedy_outputs_of_the_dynamic_arm_equal_the_in_flight_arm(server, stream):
    asked = dict(max_tokens=24, temperature=0.0, ignore_eos=True, stream=stream, return_finish_reason=True,
                 return_num_input_tokens=True, return_num_output_tokens=True, return_num_cached_tokens=True)
    for prompt in PROMPTS:
        inflight, err_a = generate(server.grpc_url, "llm", prompt, **asked)
        dynamic, err_b = generate(server.grpc_url, "llm_ensemble", prompt, **asked)
        assert err_a is None and err_b is None, (err_a, err_b)
        assert text_of(dynamic) == text_of(inflight) and text_of(inflight)
        for responses in (inflight, dynamic):
            assert responses[-1]["finish_reason"] == [b"length"]
            assert sum(r["num_output_tokens"][0] for r in responses) == 24
            assert all(r["finish_reason"] == [b"None"] for r in responses[:-1])  # vLLM's backend does the same
        assert dynamic[-1]["num_input_tokens"] == inflight[-1]["num_input_tokens"]
        for responses in (inflight, dynamic):  # asked, so answered on both arms (each engine has its own cache)
            assert 0 <= responses[-1]["num_cached_tokens"][0] <= responses[-1]["num_input_tokens"][0]
        if not stream:
            assert len(dynamic) == 1


def test_streamed_text_equals_the_whole_text_through_the_ensemble(server):
    for prompt in PROMPTS:
        streamed, _ = generate(server.grpc_url, "llm_ensemble", prompt, max_tokens=30, temperature=0.0,
                               ignore_eos=True, stream=True)
        whole, _ = generate(server.grpc_url, "llm_ensemble", prompt, max_tokens=30, temperature=0.0, ignore_eos=True)
        assert len(streamed) > 1 and text_of(streamed) == text_of(whole)


def test_triton_hands_execute_several_requests_and_a_bad_one_costs_only_itself(server):
    before = batch_sizes(server.metrics_url)
    results: dict[int, tuple] = {}

    def one(i: int) -> None:
        # Request 3 passes preprocessing but is refused by the engine inside the batch (too long).
        max_tokens = 5000 if i == 3 else 6 + i
        results[i] = generate(server.grpc_url, "llm_ensemble", f"Request number {i}:", max_tokens=max_tokens,
                              temperature=0.0, ignore_eos=True, stream=True, return_num_output_tokens=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    after = batch_sizes(server.metrics_url)
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
    assert sum(k * v for k, v in new.items()) == 8, new
    assert max(new) > 1, f"execute only ever received single requests: {new}"
    assert "max_model_len" in (results[3][1] or "")
    for i in set(range(8)) - {3}:
        responses, error = results[i]
        assert error is None and sum(r["num_output_tokens"][0] for r in responses) == 6 + i
    assert "batch of" in server.log_text()


def test_a_cancelled_ensemble_stream_stops_its_row_in_llm_dynamic(server):
    """Triton 2.51 does not cancel an ensemble step that is running, only the steps it schedules after the cancel:
    postprocessing's next call arrives marked and posts the row's key (dynamic_arm/cancel_relay.py), and
    llm_dynamic aborts the row instead of computing all of its max_tokens."""
    max_tokens = 1500
    offset, started = len(server.log_text()), time.time()
    ended_before = ensemble_requests_ended(server)
    client = StreamClient(server.grpc_url)
    client.send("llm_ensemble", "victim", PROMPTS[2], {"max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    try:
        assert client.wait_responses("victim", 2, timeout_s=60)
    finally:
        client.close(cancel=True)
    deadline = time.monotonic() + 60
    while "ensemble cancels relayed" not in server.log_text()[offset:]:
        assert time.monotonic() < deadline, "llm_dynamic's batch never ended"
        time.sleep(0.1)
    line = next(ln for ln in server.log_text()[offset:].splitlines() if "ensemble cancels relayed" in ln)
    steps = int(re.search(r": (\d+) steps in", line).group(1))
    assert "1 ensemble cancels relayed" in line and steps < max_tokens // 2, line
    # Triton released the ensemble request (no step of it failed, so its ensemble completed).
    while ensemble_requests_ended(server) == ended_before:
        assert time.monotonic() < deadline, "llm_ensemble still holds the cancelled request"
        time.sleep(0.1)
    # The arm serves on, and the relay left no post behind.
    got, error = generate(server.grpc_url, "llm_ensemble", PROMPTS[0], max_tokens=5, ignore_eos=True, stream=True)
    assert error is None and text_of(got)
    assert not [p.name for p in CancelRelay().directory.glob("*") if p.stat().st_mtime >= started - 1]


def triton_failures(server, model: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("nv_inference_request_failure{") and f'model="{model}"' in line)


def test_triton_counts_each_refused_ensemble_request_twice(server):
    """Why docker/prometheus/alerts.yml halves llm_ensemble's failure count: Triton 2.51 reports a failed ensemble
    request both when it sends the error and when it releases the request. If this changes, change the rule."""
    before = triton_failures(server, "llm_ensemble")
    for _ in range(3):
        _, error = generate(server.grpc_url, "llm_ensemble", "", max_tokens=4)
        assert error is not None and "text_input" in error
    deadline = time.monotonic() + 15  # Triton refreshes /metrics every 2 s
    while triton_failures(server, "llm_ensemble") < before + 6:
        assert time.monotonic() < deadline, triton_failures(server, "llm_ensemble") - before
        time.sleep(0.5)
    time.sleep(2.5)
    assert triton_failures(server, "llm_ensemble") == before + 6
    assert triton_failures(server, "preprocessing") == 0  # the step that refused them counts none


def ensemble_requests_ended(server) -> int:
    """Requests llm_ensemble has released, by Triton's statistics (it counts a request once it lets it go)."""
    stats = grpcclient.InferenceServerClient(server.grpc_url).get_inference_statistics("llm_ensemble", as_json=True)
    infer = stats["model_stats"][0]["inference_stats"]
    return sum(int(infer.get(k, {}).get("count", 0)) for k in ("success", "fail"))


def test_config_swap_serves_llm_with_the_dynamic_arm(repo, server, tmp_path):
    expected, _ = generate(server.grpc_url, "llm", PROMPTS[0], max_tokens=12, temperature=0.0, ignore_eos=True)
    with TritonServer(repo, ["--model-config-name=dynamic"], log_path=tmp_path / "swap.log",
                      env={"OMP_NUM_THREADS": "1"}) as swapped:
        client = grpcclient.InferenceServerClient(swapped.grpc_url)
        assert client.get_model_config("llm").config.platform == "ensemble"
        got, error = generate(swapped.grpc_url, "llm", PROMPTS[0], max_tokens=12, temperature=0.0, ignore_eos=True)
        assert error is None and text_of(got) == text_of(expected)
        assert sum(batch_sizes(swapped.metrics_url).values()) == 1  # it went through llm_dynamic
    assert swapped.leftovers() == []


def test_the_harness_runs_end_to_end_in_tiny_mode(tmp_path):
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "perf.ab", "--tiny", "--results-dir", str(tmp_path), "--name", "tiny"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "tiny"
    report = (out / "report.md").read_text()
    assert "| mixed | 4 |" in report and "genai-perf cross-check" in report
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {r["arm"] for r in rows} == {"inflight", "iterative", "dynamic"} and all(not r["error"] for r in rows)
    assert all(float(r["tokens_per_s"]) > 0 for r in rows)
    for name in ("throughput_vs_concurrency.png", "latency_percentiles.png", "latency_vs_throughput.png"):
        assert (out / name).stat().st_size > 1000
    assert "[ab] 1/" in done.stdout  # progress while it runs
    assert time.monotonic() - t0 < 120
