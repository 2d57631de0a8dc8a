"""Faults, overload and hostile input against the real tritonserver: every request gets exactly one final
response, no KV block leaks, the server keeps serving. After every case the models are checked quiescent
(tests/quiescence.py). Engine faults and slow steps come from the fault hooks (tests/fault_hooks.py, copied beside
each model.py and loaded by request_hook_module; request parameter inject_fault), so timing windows are wide and sure.

One server for most cases, three copies of the llm model on the tiny random Llama:
  tiny         ample pool (512 blocks), step budget 64 tokens (long prompts prefill in chunks), hooks on
  tiny_pool    24 blocks of 16 tokens (pressure: preemption), hooks off
  tiny_serial  max_num_seqs 1 (a second request must queue), max_queue_size 4, hooks on
Shutdown and unload get servers of their own.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import fault_hooks
from engine_helpers import MODEL_REPOSITORY
from server_harness.repository import make_model_repository
from server_harness.quiescence import assert_quiescent, http_status, scrape
from server_harness.stream_client import StreamClient, finals_problems
from server_harness.server import STUB_ARG_PARENT, TritonServer, python_stubs

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
POOLS = {"tiny": 512, "tiny_pool": 24, "tiny_serial": 64}
COMMON = {"model": TINY, "metrics_interval_ms": 100, "cancel_check_period_ms": 50, "default_max_tokens": 32}
MODELS = {
    "tiny": {**COMMON, "num_kv_blocks": 512, "max_model_len": 512, "max_num_batched_tokens": 64,
             **fault_hooks.ON},
    "tiny_pool": {**COMMON, "num_kv_blocks": 24, "max_model_len": 1024},
    "tiny_serial": {**COMMON, "num_kv_blocks": 64, "max_model_len": 512, "max_num_seqs": 1, "max_queue_size": 4,
                    **fault_hooks.ON},
}
HOOKED = ("tiny", "tiny_serial")
CANCELLED = "vllm:request_success_total{finished_reason=cancelled}"
STREAM = {"stream": True, "ignore_eos": True, "return_num_output_tokens": True, "return_finish_reason": True}

pytestmark = pytest.mark.timeout(300)


def _need_models():
    if not (TINY / "config.json").exists():
        pytest.skip(f"{TINY} missing: run `make setup`")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    _need_models()
    tmp = tmp_path_factory.mktemp("faults")
    repo = make_model_repository(MODEL_REPOSITORY, tmp / "repo", MODELS, files=[fault_hooks.FILE])
    srv = TritonServer(repo, log_path=tmp / "server.log")
    print(f"tritonserver log: {srv.log_path}")
    with srv:
        yield srv
    assert srv.leftovers() == []


@pytest.fixture(autouse=True)
def quiescent_after(request):
    """After every case that used the shared server: end any slow phase, then all three models quiescent."""
    yield
    if "server" not in request.fixturenames:
        return
    srv = request.getfixturevalue("server")
    for model in HOOKED:
        r = generate(srv, model, "reset", {"max_tokens": 1}, {"inject_fault": "slow:ms=1,steps=1"})
        assert r.num_finals == 1 and r.error is None, r.error
    for model, blocks in POOLS.items():
        assert_quiescent(srv, model, blocks)


# ---- helpers -----------------------------------------------------------------------------------------

def generate(srv, model, prompt, values=None, parameters=None, timeout_s=60.0):
    c = StreamClient(srv.grpc_url)
    try:
        c.send(model, "r", prompt, values, parameters)
        assert c.wait_finals(timeout_s), "no final response"
        assert finals_problems([c], linger_s=0.1) == []
        return c.records["r"]
    finally:
        c.close()


def metric(srv, model, name):
    return scrape(srv.metrics_url, model).get(name, 0.0)


def wait_metric(srv, model, name, check, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = metric(srv, model, name)
        if check(value):
            return value
        time.sleep(0.05)
    raise AssertionError(f"{model} {name} = {metric(srv, model, name)}: condition not met in {timeout_s} s")


def stop_request(srv, model, request_id):
    """TensorRT-LLM style cancel: a request with the same id and the parameter stop=true."""
    c = StreamClient(srv.grpc_url)
    try:
        c.send(model, request_id, "", {}, {"stop": True})
        assert c.wait_finals(10)
        r = c.records[request_id]
        assert r.error is None and r.num_finals == 1
    finally:
        c.close()
    return r


# ---- cancellation at every stage ------------------------------------------------------------------------

def test_cancel_while_queued(server):
    before = metric(server, "tiny_serial", CANCELLED)
    runner = StreamClient(server.grpc_url)
    runner.send("tiny_serial", "runner", "I run first", {**STREAM, "max_tokens": 60},
                {"inject_fault": "slow:ms=30,steps=40"})
    assert runner.wait_responses("runner", 1)
    queued, queued2 = StreamClient(server.grpc_url), StreamClient(server.grpc_url)
    queued.send("tiny_serial", "queued", "I wait", {**STREAM, "max_tokens": 20})
    queued2.send("tiny_serial", "queued2", "I wait too", {**STREAM, "max_tokens": 20})
    wait_metric(server, "tiny_serial", "vllm:num_requests_waiting", lambda v: v == 2)
    stop_request(server, "tiny_serial", "queued")  # cancel by id: the final reaches this client
    queued2.close(cancel=True)  # the client's own gRPC cancel: seen on the server's counters
    assert queued.wait_finals(10)
    r = queued.records["queued"]
    assert r.num_finals == 1 and r.num_responses == 0 and "cancelled by a stop request" in r.error
    assert runner.wait_finals(60)
    assert runner.records["runner"].num_output_tokens == 60 and runner.records["runner"].error is None
    assert finals_problems([runner, queued]) == []
    queued.close(), runner.close()
    wait_metric(server, "tiny_serial", CANCELLED, lambda v: v == before + 2)


def test_a_full_queue_refuses_at_once_and_the_queued_still_complete(server):
    runner = StreamClient(server.grpc_url)
    runner.send("tiny_serial", "runner", "I run first", {**STREAM, "max_tokens": 30},
                {"inject_fault": "slow:ms=30,steps=40"})
    assert runner.wait_responses("runner", 1)
    c = StreamClient(server.grpc_url)
    for i in range(4):
        c.send("tiny_serial", f"q{i}", f"Queued {i}", {**STREAM, "max_tokens": 5})
    wait_metric(server, "tiny_serial", "vllm:num_requests_waiting", lambda v: v == 4)
    t0 = time.monotonic()
    for i in range(2):
        c.send("tiny_serial", f"over{i}", "One too many", {**STREAM, "max_tokens": 5})
    assert c.wait_finals(5, ids=["over0", "over1"]) and time.monotonic() - t0 < 5
    for i in range(2):
        r = c.records[f"over{i}"]
        assert r.num_responses == 0 and "queue is full" in r.error and "max_queue_size=4" in r.error
    assert c.wait_finals(60) and runner.wait_finals(60)
    assert finals_problems([c, runner]) == []
    for i in range(4):
        assert c.records[f"q{i}"].error is None and c.records[f"q{i}"].num_output_tokens == 5
    c.close(), runner.close()


def test_cancel_during_prefill(server):
    before = scrape(server.metrics_url, "tiny")
    c = StreamClient(server.grpc_url)
    # ~420 prompt tokens at 64 per step: 7 prefill steps of >= 300 ms each before any token exists.
    c.send("tiny", "long_prompt", "word " * 420, {**STREAM, "max_tokens": 8},
           {"inject_fault": "slow:ms=300,steps=10"})
    wait_metric(server, "tiny", "vllm:num_requests_running", lambda v: v == 1)
    assert c.records["long_prompt"].num_responses == 0, "prefill finished before the cancel"
    c.close(cancel=True)
    wait_metric(server, "tiny", CANCELLED, lambda v: v == before.get(CANCELLED, 0) + 1)
    m = scrape(server.metrics_url, "tiny")
    assert m["vllm:generation_tokens_total"] == before.get("vllm:generation_tokens_total", 0), "a token was made"
    assert m["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0), "never scheduled"


def test_cancel_during_decode(server):
    before = metric(server, "tiny", "vllm:generation_tokens_total")
    c = StreamClient(server.grpc_url)
    c.send("tiny", "decoding", "Tell me a long story", {**STREAM, "max_tokens": 300},
           {"inject_fault": "slow:ms=20,steps=300"})
    assert c.wait_responses("decoding", 5)
    stop_request(server, "tiny", "decoding")
    assert c.wait_finals(10)
    r = c.records["decoding"]
    assert r.num_finals == 1 and r.num_responses >= 5 and "cancelled" in r.error and not r.finish_reasons
    assert finals_problems([c]) == []
    c.close()
    wait_metric(server, "tiny", "inflight:num_requests_inflight", lambda v: v == 0)
    assert metric(server, "tiny", "vllm:generation_tokens_total") - before < 300


def test_cancel_after_the_final_response(server):
    c = StreamClient(server.grpc_url)
    c.send("tiny", "done", "Short", {**STREAM, "max_tokens": 4})
    assert c.wait_finals(30)
    # A stop request for a finished id finds nothing: its own empty final, nothing else for `done`.
    stop_request(server, "tiny", "done")
    assert finals_problems([c]) == []
    r = c.records["done"]
    assert r.num_output_tokens == 4 and r.finish_reasons == ["length"]
    c.close(cancel=True)  # the client's gRPC cancel after the final: must not touch a finished sender
    assert http_status(f"{server.http_base}/v2/health/live") == 200
    again = generate(server, "tiny", "Still fine?", {**STREAM, "max_tokens": 3})
    assert again.num_output_tokens == 3 and again.error is None


_DOOMED_CLIENT = """
import sys, time
from server_harness.stream_client import StreamClient
c = StreamClient(sys.argv[1])
c.send("tiny", "doomed", "Keep talking", {"stream": True, "ignore_eos": True, "max_tokens": 400},
       {"inject_fault": "slow:ms=25,steps=400"})
assert c.wait_responses("doomed", 2, 60)
print("streaming", flush=True)
time.sleep(600)
"""


def test_client_process_killed_mid_stream(server):
    before = scrape(server.metrics_url, "tiny")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_CLIENT, server.grpc_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 90)
        assert ready and proc.stdout.readline().strip() == b"streaming", proc.stderr.read1(4000) if not ready else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Cancelled server-side (Triton sees the stream die), long before 400 slow tokens (>= 10 s) are done.
    t0 = time.monotonic()
    wait_metric(server, "tiny", CANCELLED, lambda v: v == before.get(CANCELLED, 0) + 1, timeout_s=8)
    assert time.monotonic() - t0 < 8
    assert metric(server, "tiny", "vllm:generation_tokens_total") - before.get("vllm:generation_tokens_total", 0) < 400


def test_cancel_storm_then_a_fresh_request_is_served_within_5_s(server):
    before = scrape(server.metrics_url, "tiny")
    clients = [StreamClient(server.grpc_url) for _ in range(100)]
    try:
        for i, c in enumerate(clients):
            c.send("tiny", f"storm{i}", f"Storm request {i}", {**STREAM, "max_tokens": 200},
                   {"inject_fault": "slow:ms=10,steps=100000"} if i == 0 else None)
        # All 100 accepted (64 running, 36 waiting for a slot), none finished.
        wait_metric(server, "tiny", "inflight:num_requests_inflight", lambda v: v == 100)
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda c: c.close(cancel=True), clients))
    finally:
        for c in clients:
            c.close()
    t0 = time.monotonic()
    fresh = generate(server, "tiny", "After the storm", {**STREAM, "max_tokens": 6}, timeout_s=5)
    assert time.monotonic() - t0 < 5 and fresh.num_output_tokens == 6 and fresh.error is None
    after = wait_metric(server, "tiny", CANCELLED, lambda v: v >= before.get(CANCELLED, 0) + 100)
    assert after == before.get(CANCELLED, 0) + 100  # every storm request ended once, as cancelled
    # The exporter publishes one counter after another, so a scrape may see the cancels before the length
    # finish of the same export pass: wait for it too.
    length = "vllm:request_success_total{finished_reason=length}"
    finished = wait_metric(server, "tiny", length, lambda v: v >= before.get(length, 0) + 1)
    assert finished == before.get(length, 0) + 1  # only the fresh request finished by length


# ---- memory pressure -------------------------------------------------------------------------------------

def _run_64(server, model):
    clients = [StreamClient(server.grpc_url) for _ in range(8)]
    for i in range(64):
        prompt = f"Request {i}: the quick brown fox jumps over the lazy dog, number {i * 7}."
        clients[i % 8].send(model, f"p{i}", prompt, {**STREAM, "temperature": 0.0, "max_tokens": 40})
    for c in clients:
        assert c.wait_finals(240)
    assert finals_problems(clients) == []
    records = {k: r for c in clients for k, r in c.records.items()}
    for c in clients:
        c.close()
    return records


def test_tiny_pool_preempts_64_long_requests_and_each_matches_the_unpressured_run(server):
    pre_pool = metric(server, "tiny_pool", "vllm:num_preemptions_total")
    pre_tiny = metric(server, "tiny", "vllm:num_preemptions_total")
    pressured = _run_64(server, "tiny_pool")  # 64 x ~4 blocks against a pool of 24
    ample = _run_64(server, "tiny")
    assert wait_metric(server, "tiny_pool", "vllm:num_preemptions_total", lambda v: v > pre_pool) > pre_pool
    assert metric(server, "tiny", "vllm:num_preemptions_total") == pre_tiny
    for rid, r in pressured.items():
        assert r.error is None and r.num_output_tokens == 40 and r.finish_reasons == ["length"], rid
        assert r.text == ample[rid].text, rid


def test_prompt_larger_than_the_whole_pool_is_refused_clearly(server):
    r = generate(server, "tiny_pool", "word " * 600, {"max_tokens": 4})
    assert r.num_responses == 0
    assert "KV blocks" in r.error and "allowed at most the whole pool of 24" in r.error


# ---- hostile input ---------------------------------------------------------------------------------------

J = json.dumps
# name -> (values as typed input tensors, request parameters, strings the error must contain)
BAD_PARAMETERS = {
    "max_tokens_zero": ({"max_tokens": 0}, None, ["max_tokens=0", "allowed an integer >= 1"]),
    "max_tokens_negative_json": ({"sampling_parameters": J({"max_tokens": -5})}, None, ["max_tokens=-5", ">= 1"]),
    "max_tokens_float_json": ({"sampling_parameters": J({"max_tokens": 1.5})}, None, ["max_tokens=1.5"]),
    "max_tokens_text_json": ({"sampling_parameters": J({"max_tokens": "ten"})}, None, ["max_tokens='ten'"]),
    "min_tokens_negative": ({"min_tokens": -1}, None, ["min_tokens=-1", ">= 0"]),
    "min_over_max": ({"sampling_parameters": J({"max_tokens": 4, "min_tokens": 9})}, None,
                     ["min_tokens=9", "max_tokens=4"]),
    "temperature_negative": ({"temperature": -0.5}, None, ["temperature=-0.5", "[0, 100]"]),
    "temperature_huge_param": ({}, {"temperature": 101.0}, ["temperature=101.0", "[0, 100]"]),
    "temperature_nan_json": ({"sampling_parameters": '{"temperature": "nan"}'}, None, ["temperature='nan'", "number"]),
    "temperature_list_json": ({"sampling_parameters": J({"temperature": [1]})}, None, ["temperature=[1]"]),
    "temperature_bool_json": ({"sampling_parameters": J({"temperature": True})}, None, ["temperature=True"]),
    "top_p_zero": ({"top_p": 0.0}, None, ["top_p=0.0", "(0, 1]"]),
    "top_p_param": ({}, {"top_p": 1.5}, ["top_p=1.5", "(0, 1]"]),
    "top_k": ({"top_k": -2}, None, ["top_k=-2", ">= -1"]),
    "min_p_json": ({"sampling_parameters": J({"min_p": 1.5})}, None, ["min_p=1.5", "[0, 1]"]),
    "seed_json": ({"sampling_parameters": J({"seed": -1})}, None, ["seed=-1", "[0, 2^64)"]),
    "repetition_penalty": ({"repetition_penalty": 0.0}, None, ["repetition_penalty=0.0", "(0, 10]"]),
    "repetition_penalty_param": ({}, {"repetition_penalty": 11.0}, ["repetition_penalty=11.0", "(0, 10]"]),
    "presence_penalty": ({"presence_penalty": 2.5}, None, ["presence_penalty=2.5", "[-2, 2]"]),
    "frequency_penalty": ({"frequency_penalty": -3.0}, None, ["frequency_penalty=-3.0", "[-2, 2]"]),
    "too_many_stop_words": ({"stop_words": [f"s{i}" for i in range(33)]}, None, ["<33 words>", "at most 32"]),
    "number_stop_word": ({"sampling_parameters": J({"stop": ["ok", 7]})}, None, ["stop=7", "strings"]),
    "huge_stop_word": ({"sampling_parameters": J({"stop": ["x" * 2000]})}, None, ["at most 1024 bytes"]),
    "too_many_bad_words": ({"bad_words": [f"b{i}" for i in range(40)]}, None, ["bad_words", "at most 32"]),
    "stop_token_id": ({"sampling_parameters": J({"stop_token_ids": [-1]})}, None, ["stop_token_ids=-1"]),
    "priority_json": ({"sampling_parameters": J({"priority": 2**31})}, None, ["priority=2147483648", "32-bit"]),
    "ignore_eos_param": ({}, {"ignore_eos": "maybe"}, ["ignore_eos='maybe'", "boolean"]),
    "stream_json": ({"sampling_parameters": J({"stream": "maybe"})}, None, ["stream='maybe'", "boolean"]),
    "bad_json": ({"sampling_parameters": "{max_tokens: 4"}, None, ["sampling_parameters='{max_tokens: 4'", "JSON"]),
    "json_not_object": ({"sampling_parameters": "[1, 2]"}, None, ["sampling_parameters='[1, 2]'", "JSON object"]),
    "json_unknown_key": ({"sampling_parameters": J({"best_of": 2})}, None, ["'best_of' is unknown", "max_tokens"]),
    "json_too_big": ({"sampling_parameters": J({"stop": ["y"] * 20000})}, None, ["at most 65536 bytes"]),
    "json_bad_utf8": ({"sampling_parameters": b'{"stop": "\xff"}'}, None, ["sampling_parameters=", "JSON"]),
    "unknown_parameter": ({}, {"best_of": 2}, ["request parameter 'best_of' is unknown"]),
    "conflicting_values": ({"max_tokens": 4}, {"max_tokens": 5}, ["max_tokens=5", "conflicts", "max_tokens=4"]),
    "bad_fault_spec": ({}, {"inject_fault": "boom"}, ["inject_fault='boom'", "allowed"]),
}


def test_invalid_parameter_matrix_each_gets_a_clear_error_and_no_one_else_does(server):
    good = StreamClient(server.grpc_url)
    good.send("tiny", "good", "A good request", {**STREAM, "max_tokens": 24})
    bad = StreamClient(server.grpc_url)
    for name, (values, params, _) in BAD_PARAMETERS.items():
        bad.send("tiny", name, "Hi", values, params)
    assert bad.wait_finals(60) and good.wait_finals(60)
    assert finals_problems([good, bad]) == []
    for name, (_, _, needles) in BAD_PARAMETERS.items():
        r = bad.records[name]
        assert r.num_responses == 0 and r.error, name
        assert r.error.endswith(f"(request id '{name}')"), r.error
        for needle in needles:
            assert needle in r.error, f"{name}: {needle!r} not in {r.error!r}"
    g = good.records["good"]
    assert g.error is None and g.num_output_tokens == 24 and g.finish_reasons == ["length"]
    good.close(), bad.close()


def test_inject_fault_is_unknown_where_hooks_are_off(server):
    r = generate(server, "tiny_pool", "Hi", {"max_tokens": 2}, {"inject_fault": "error"})
    assert "request parameter 'inject_fault' is unknown" in r.error


BAD_INPUTS = {
    "empty_prompt": ("", {}, ["text_input=''", "empty"]),
    "invalid_utf8": (b"caf\xc3(\xff\xfe", {}, ["text_input=b'caf\\xc3(\\xff\\xfe'", "UTF-8"]),
    "missing_text_input": (None, {"max_tokens": 3}, ["text_input is missing"]),
    "text_two_prompts": (np.array([b"a", b"b"], dtype=np.object_), {}, ["text_input", "shape", "[1]"]),
    "text_2d": (np.array([[b"a"]], dtype=np.object_), {}, ["text_input", "shape"]),
    "text_as_int32": (np.array([7], dtype=np.int32), {}, ["text_input", "INT32"]),
    "max_tokens_fp32": ("Hi", {"max_tokens": 3.0}, ["max_tokens", "FP32", "INT32"]),
    "max_tokens_two_values": ("Hi", {"max_tokens": np.array([3, 4], dtype=np.int32)}, ["max_tokens", "shape"]),
    "unknown_input": ("Hi", {"nosuch": 1.0}, ["nosuch"]),
}


def test_bad_inputs_shapes_and_dtypes_each_get_one_clear_error(server):
    # One stream each: some of Triton's own refusals carry no request id.
    clients = {name: StreamClient(server.grpc_url, anonymous_errors=True) for name in BAD_INPUTS}
    for name, (prompt, values, _) in BAD_INPUTS.items():
        clients[name].send("tiny", name, prompt, values)
    for name, c in clients.items():
        assert c.wait_finals(30), name
    assert finals_problems(list(clients.values())) == []
    for name, (_, _, needles) in BAD_INPUTS.items():
        r = clients[name].records[name]
        assert r.num_responses == 0 and r.error, name
        for needle in needles:
            assert needle in r.error, f"{name}: {needle!r} not in {r.error!r}"
        clients[name].close()


def _stub_pid(server, model):
    pids = [pid for pid, argv in python_stubs()
            if len(argv) > STUB_ARG_PARENT and argv[STUB_ARG_PARENT] == str(server.pid)
            and f"/{model}/1/model.py" in argv[1]]
    assert len(pids) == 1, pids
    return pids[0]


def _rss_mb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_100_oversize_prompts_are_refused_before_tokenizing_with_bounded_memory(server):
    big = np.array([b"x" * (4 << 20)], dtype=np.object_)  # 4 MiB, the cap is 1 MiB
    stub = _stub_pid(server, "tiny")

    def send(n, prefix):
        c = StreamClient(server.grpc_url)
        for i in range(n):
            c.send("tiny", f"{prefix}{i}", big, {"max_tokens": 4})
            if i % 10 == 9:
                assert c.wait_finals(60)
        assert c.wait_finals(60)
        assert finals_problems([c], linger_s=0.1) == []
        c.close()
        return c.records

    send(5, "warm")  # the stub's shared memory grows to fit a 4 MiB request once; count that as baseline
    tokens_before = metric(server, "tiny", "vllm:prompt_tokens_total")
    rss_before = _rss_mb(stub)
    t0 = time.monotonic()
    records = send(100, "big")
    elapsed = time.monotonic() - t0
    rss_after = _rss_mb(stub)
    for rid, r in records.items():
        assert r.num_responses == 0 and "text_input=<4194304 bytes>" in r.error, rid
        assert "text_input=<4194304 bytes> is out of range" in r.error and "max_prompt_bytes=1048576" in r.error
    assert metric(server, "tiny", "vllm:prompt_tokens_total") == tokens_before  # nothing reached the engine
    assert rss_after - rss_before < 48, f"stub RSS grew {rss_after - rss_before:.0f} MB over 100 x 4 MiB"
    assert elapsed < 90, f"{elapsed:.0f} s for 100 refusals: was something tokenized?"
    print(f"stub RSS {rss_before:.0f} -> {rss_after:.0f} MB; 100 refusals in {elapsed:.1f} s")


def test_duplicate_request_ids_are_kept_apart(server):
    a, b = StreamClient(server.grpc_url), StreamClient(server.grpc_url)
    a.send("tiny", "dup", "First", {**STREAM, "max_tokens": 5})
    b.send("tiny", "dup", "Second one", {**STREAM, "max_tokens": 9})
    a.send("tiny", "twin", "Same stream", {**STREAM, "max_tokens": 3, "stream": False})
    a.send("tiny", "twin", "Same stream again", {**STREAM, "max_tokens": 7, "stream": False})
    assert a.wait_finals(60) and b.wait_finals(60)
    assert finals_problems([a, b]) == []
    assert a.records["dup"].num_output_tokens == 5 and b.records["dup"].num_output_tokens == 9
    twin = a.records["twin"]
    assert (twin.num_finals, twin.num_responses, twin.num_output_tokens) == (2, 2, 10)
    a.close(), b.close()


# ---- engine faults, unload, shutdown -------------------------------------------------------------------------

def _fail_engine_mid_run(srv, model, num_victims):
    """num_victims slow streams in flight, then a request that arms an engine error 3 steps on: every one
    gets exactly one final, an error naming the fault."""
    before = scrape(srv.metrics_url, model)
    c = StreamClient(srv.grpc_url)
    for i in range(num_victims):
        c.send(model, f"v{i}", f"Victim {i}", {**STREAM, "max_tokens": 200},
               {"inject_fault": "slow:ms=10,steps=100000"} if i == 0 else None)
    for i in range(num_victims):
        assert c.wait_responses(f"v{i}", 2)
    c.send(model, "trigger", "Trigger", {**STREAM, "max_tokens": 200}, {"inject_fault": "error:after=3"})
    assert c.wait_finals(30)
    assert finals_problems([c]) == []
    for rid, r in c.records.items():
        assert "engine error: InjectedFault: fault injected by a test hook" in r.error, rid
    c.close()
    error = "vllm:request_success_total{finished_reason=error}"
    wait_metric(srv, model, error, lambda v: v == before.get(error, 0) + num_victims + 1)


def test_engine_exception_mid_run_errors_every_request_once_and_the_model_recovers(server):
    _fail_engine_mid_run(server, "tiny", 6)
    generate(server, "tiny", "x", {"max_tokens": 1}, {"inject_fault": "slow:ms=1,steps=1"})
    fresh = generate(server, "tiny", "Back to work", {**STREAM, "max_tokens": 12})
    assert fresh.error is None and fresh.num_output_tokens == 12 and fresh.finish_reasons == ["length"]


def _own_server(factory, tmp_path, **kwargs):
    _need_models()
    repo = make_model_repository(MODEL_REPOSITORY, tmp_path / "repo", {"tiny": MODELS["tiny"]},
                                 files=[fault_hooks.FILE])
    return factory(repo, **kwargs)


def _slow_streams(srv, n):
    clients = [StreamClient(srv.grpc_url) for _ in range(n)]
    for i, c in enumerate(clients):
        c.send("tiny", f"s{i}", f"Stream {i}", {**STREAM, "max_tokens": 400},
               {"inject_fault": "slow:ms=20,steps=100000"} if i == 0 else None)
    for i, c in enumerate(clients):
        assert c.wait_responses(f"s{i}", 2)
    return clients


def test_unload_after_an_engine_fault_does_not_hang(triton_server_factory, tmp_path):
    srv = _own_server(triton_server_factory, tmp_path, model_control_mode="explicit", extra_args=["--load-model=tiny"])
    _fail_engine_mid_run(srv, "tiny", 3)
    assert_quiescent(srv, "tiny", POOLS["tiny"])
    clients = _slow_streams(srv, 4)
    t0 = time.monotonic()
    req = urllib.request.Request(f"{srv.http_base}/v2/repository/models/tiny/unload", data=b"{}", method="POST")
    unload = threading.Thread(target=lambda: urllib.request.urlopen(req, timeout=60).read())
    unload.start()
    for c in clients:  # each in-flight request ends once; then the client closes its stream
        assert c.wait_finals(10)
        assert "the model is being unloaded" in next(iter(c.records.values())).error
        c.close()
    assert finals_problems(clients) == []
    unload.join(30)
    assert not unload.is_alive()
    # Unloaded for good (finalize ran), not merely "not ready": the repository index says UNAVAILABLE.
    deadline = time.monotonic() + 30
    while _repository_state(srv, "tiny") != "UNAVAILABLE" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _repository_state(srv, "tiny") == "UNAVAILABLE", srv.log_tail()
    assert time.monotonic() - t0 < 30
    assert http_status(f"{srv.http_base}/v2/models/tiny/ready") != 200
    assert "finalize: done" in srv.log_text()
    assert http_status(f"{srv.http_base}/v2/health/live") == 200


def _repository_state(srv, model):
    req = urllib.request.Request(f"{srv.http_base}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        index = json.loads(resp.read())
    return next((m.get("state") for m in index if m["name"] == model), None)


def test_shutdown_with_requests_in_flight_gives_each_a_final_and_leaves_nothing(triton_server_factory, tmp_path):
    srv = _own_server(triton_server_factory, tmp_path, exit_timeout_s=20)
    clients = _slow_streams(srv, 8)
    t0 = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    for c in clients:
        assert c.wait_finals(15)
        c.close()  # a well-behaved client: Triton 2.51 holds the model while any gRPC stream is open
    assert finals_problems(clients) == []
    for c in clients:
        assert "the model is being unloaded" in next(iter(c.records.values())).error
    stopper.join(60)
    assert not stopper.is_alive() and time.monotonic() - t0 < 20
    assert "Exit timeout expired" not in srv.log_text() and "finalize: done" in srv.log_text()
    assert srv.leftovers() == []
