"""The third arm on the real tritonserver (tiny-llama, loopback): `llm_iterative`, Triton's iterative sequence
batcher around one engine step per execute. The contract and streaming match `llm`, cancellation and bad input
cost nothing to anyone else and leave the KV pool whole, and each sharp edge of Triton's batcher is either handled
or shown here as the limit it is (docs/ab.md, "The iterative arm's sharp edges")."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fault_hooks
from engine_helpers import MODEL_REPOSITORY
from grpc_helpers import infer_inputs, stream_to_final
from server_harness.quiescence import assert_quiescent, scrape
from server_harness.repository import copy_model
from server_harness.stream_client import StreamClient, finals_problems
from serving.metrics_export import REQUEST_SUCCESS

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
NUM_BLOCKS = 128
ENGINE = {"model": str(TINY), "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 64}
PROMPTS = ["The capital of France is", "Café au lait, naïve résumé: ☕ ", "1, 2, 3, 4,"]
_DTYPES = {bool: np.bool_, int: np.int32, float: np.float32}
LENGTH_FINISHES = REQUEST_SUCCESS.name + "{finished_reason=length}"  # as scrape() keys a labelled sample


def batched(values: dict) -> dict:
    """The contract's values as the iterative arm takes them: each with the batch dimension ([1, 1])."""
    out = {}
    for name, value in values.items():
        if isinstance(value, str):
            out[name] = np.array([[value.encode()]], dtype=np.object_)
        else:
            out[name] = np.array([[value]], dtype=_DTYPES[type(value)])
    return out


def two_slots(config) -> None:
    config.max_batch_size = 2


def short_idle(config) -> None:
    config.sequence_batching.max_sequence_idle_microseconds = 400_000


ENSEMBLE = """name: "iterative_ensemble"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] },
  { name: "ignore_eos" data_type: TYPE_BOOL dims: [ 1 ] }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [ {
  model_name: "llm_iterative" model_version: -1
  input_map { key: "text_input" value: "text_input" }
  input_map { key: "max_tokens" value: "max_tokens" }
  input_map { key: "stream" value: "stream" }
  input_map { key: "ignore_eos" value: "ignore_eos" }
  output_map { key: "text_output" value: "text_output" }
} ] }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("iterative") / "model_repository"
    copy_model(MODEL_REPOSITORY, "llm", dest, params=ENGINE)
    copy_model(MODEL_REPOSITORY, "llm_iterative", dest, params=ENGINE)
    copy_model(MODEL_REPOSITORY, "llm_iterative", dest, as_name="iterative_two_slots", params=ENGINE, edit=two_slots)
    copy_model(MODEL_REPOSITORY, "llm_iterative", dest, as_name="iterative_short_idle",
               params={**ENGINE, **fault_hooks.ON}, edit=short_idle, files=[fault_hooks.FILE])
    (dest / "iterative_ensemble" / "1").mkdir(parents=True)
    (dest / "iterative_ensemble" / "config.pbtxt").write_text(ENSEMBLE)
    return dest


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    from server_harness.server import TritonServer
    srv = TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log", env={"OMP_NUM_THREADS": "1"})
    with srv:
        yield srv
    assert srv.leftovers() == []


def stream(url: str, model: str, values: dict, batch_dim: bool = True) -> tuple[list[dict], str | None]:
    """Every response of one streaming request and the error, if any; fails unless exactly one is final."""
    arrays = batched(values) if batch_dim else {k: v[0] for k, v in batched(values).items()}
    return stream_to_final(url, model, infer_inputs(arrays))


def text_of(responses: list[dict]) -> str:
    return b"".join(np.array(r["text_output"], dtype=object).reshape(-1)[0] for r in responses
                    if "text_output" in r).decode()


def quiet(server, model: str = "llm_iterative") -> None:
    assert_quiescent(server, model, NUM_BLOCKS, timeout_s=30)


def counter(server, name: str, model: str) -> float:
    import urllib.request
    total = 0.0
    for line in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- the contract ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("streamed", [True, False])
def test_greedy_outputs_equal_the_in_flight_arm(server, streamed):
    asked = dict(max_tokens=20, temperature=0.0, ignore_eos=True, stream=streamed, return_finish_reason=True,
                 return_num_input_tokens=True, return_num_output_tokens=True)
    for prompt in PROMPTS:
        ours, err_a = stream(server.grpc_url, "llm", {"text_input": prompt, **asked}, batch_dim=False)
        theirs, err_b = stream(server.grpc_url, "llm_iterative", {"text_input": prompt, **asked})
        assert err_a is None and err_b is None, (err_a, err_b)
        assert text_of(theirs) == text_of(ours) and text_of(ours)
        assert theirs[-1]["finish_reason"] == [[b"length"]]
        assert sum(r["num_output_tokens"][0][0] for r in theirs) == 20
        assert theirs[-1]["num_input_tokens"][0] == ours[-1]["num_input_tokens"]
        if not streamed:
            assert len(theirs) == 1
    quiet(server)


def test_streamed_text_equals_the_whole_text(server):
    for prompt in PROMPTS:
        streamed, _ = stream(server.grpc_url, "llm_iterative", {"text_input": prompt, "max_tokens": 30,
                                                                "temperature": 0.0, "ignore_eos": True, "stream": True})
        whole, _ = stream(server.grpc_url, "llm_iterative", {"text_input": prompt, "max_tokens": 30,
                                                             "temperature": 0.0, "ignore_eos": True})
        assert len(streamed) > 1 and text_of(streamed) == text_of(whole)


def test_concurrent_requests_share_executes_and_each_gets_one_final(server):
    executes_before = counter(server, "llm_iterative_executes_total", "llm_iterative")
    client = StreamClient(server.grpc_url)
    lengths = [4, 9, 16, 25, 7, 12]
    try:
        for i, n in enumerate(lengths):
            client.send("llm_iterative", f"c{i}", batched({"text_input": PROMPTS[i % 3]})["text_input"],
                        batched({"max_tokens": n, "ignore_eos": True, "stream": True,
                                 "return_num_output_tokens": True}))
        assert client.wait_finals(120)
        assert finals_problems([client]) == []
        for i, n in enumerate(lengths):
            assert client.records[f"c{i}"].num_output_tokens == n and not client.records[f"c{i}"].errors
    finally:
        client.close()
    executes = counter(server, "llm_iterative_executes_total", "llm_iterative") - executes_before
    assert executes < sum(lengths), f"{executes} executes for {sum(lengths)} tokens: Triton did not batch"
    assert counter(server, "llm_iterative_null_requests_total", "llm_iterative") > 0  # short ones left holes
    quiet(server)


def test_bad_input_costs_that_request_one_error_and_nothing_else(server):
    client = StreamClient(server.grpc_url)
    try:
        client.send("llm_iterative", "good", batched({"text_input": "Hello"})["text_input"],
                    batched({"max_tokens": 12, "ignore_eos": True, "stream": True}))
        client.send("llm_iterative", "bad", batched({"text_input": "Hello"})["text_input"],
                    batched({"temperature": -1.0}))
        client.send("llm_iterative", "huge", batched({"text_input": "Hello"})["text_input"],
                    batched({"max_tokens": 10_000_000}))
        assert client.wait_finals(60)
        assert finals_problems([client]) == []
    finally:
        client.close()
    assert "temperature=-1.0 is out of range: allowed a number in [0, 100]" in client.records["bad"].error
    assert "max_tokens" in client.records["huge"].error and "allowed" in client.records["huge"].error
    assert client.records["good"].error is None and client.records["good"].text
    quiet(server)


def test_a_cancelled_stream_frees_its_kv_even_with_nothing_else_running(server):
    """Triton answers a request cancelled between executes itself and never hands it in again; with no other
    request there is no next execute either: the model's idle poller gives the KV back."""
    cancelled_before = counter(server, "llm_iterative_cancelled_between_total", "llm_iterative")
    client = StreamClient(server.grpc_url)
    client.send("llm_iterative", "long", batched({"text_input": "Count: 1, 2,"})["text_input"],
                batched({"max_tokens": 400, "ignore_eos": True, "stream": True}))
    assert client.wait_responses("long", 3, timeout_s=60)
    client.close(cancel=True)
    quiet(server)
    good, err = stream(server.grpc_url, "llm_iterative", {"text_input": "Hello", "max_tokens": 5})
    assert err is None and text_of(good)  # the server still serves
    time.sleep(1.5)  # the counters reach /metrics from the next execute's record
    assert counter(server, "llm_iterative_cancelled_between_total", "llm_iterative") - cancelled_before == 1


def test_the_cli_client_finds_the_batch_dimension_by_itself(server):
    """client/generate.py reads the model's max_batch_size and shapes its inputs (and reads the outputs) to fit."""
    out = subprocess.run([sys.executable, str(ROOT / "client" / "generate.py"), "--url", server.grpc_url, "--model",
                          "llm_iterative", "--raw", "Hello", "--max-tokens", "5", "--ignore-eos"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"completed": 1, "output_tokens": 5' in out.stderr


# ---- the sharp edges, each handled or shown as a limit ------------------------------------------------------

def test_limit_inputs_take_the_batch_dimension(server):
    """Triton's rule for any model with max_batch_size > 0: a [1]-shaped input (as `llm` takes it) is refused by
    Triton itself, naming the shape it expected; perf_analyzer and genai-perf add the dimension themselves."""
    _, err = stream(server.grpc_url, "llm_iterative", {"text_input": "Hello", "max_tokens": 4}, batch_dim=False)
    assert err is not None and "Expected [-1,1], got [1]" in err


def test_limit_a_request_with_other_inputs_waits_until_the_slot_0_request_ends(server):
    """Direct strategy: Triton builds each execute from the lowest busy slot's set of inputs and puts a NULL request
    in the slot of a request whose set differs. So B (which also sends temperature) gets its first token only once
    A (slot 0) has finished: different input sets serialize. The load generator sends one input set for all."""
    client = StreamClient(server.grpc_url)
    try:
        client.send("llm_iterative", "A", batched({"text_input": "Hello"})["text_input"],
                    batched({"max_tokens": 40, "ignore_eos": True, "stream": True}))
        assert client.wait_responses("A", 2, timeout_s=60)  # A holds slot 0
        client.send("llm_iterative", "B", batched({"text_input": "Hello"})["text_input"],
                    batched({"max_tokens": 5, "ignore_eos": True, "stream": True, "temperature": 0.0}))
        assert client.wait_finals(120)
    finally:
        client.close()
    a, b = client.records["A"], client.records["B"]
    assert a.error is None and b.error is None
    assert b.first_response_at > a.final_at, "B ran beside A although its inputs differ"
    quiet(server)


def test_limit_sequence_slots_are_max_batch_size_and_the_rest_wait_in_triton(server):
    """iterative_two_slots has max_batch_size 2: four requests sent together run two at a time; the last two get
    their first token only after one of the first two has its final (they wait in Triton's backlog)."""
    client = StreamClient(server.grpc_url)
    try:
        for i in range(4):
            client.send("iterative_two_slots", f"s{i}", batched({"text_input": f"Hello {i}"})["text_input"],
                        batched({"max_tokens": 12, "ignore_eos": True, "stream": True}))
            time.sleep(0.05)  # arrival order = slot order
        assert client.wait_finals(120)
        assert finals_problems([client]) == []
    finally:
        client.close()
    r = [client.records[f"s{i}"] for i in range(4)]
    first_final = min(r[0].final_at, r[1].final_at)
    assert r[2].first_response_at > first_final and r[3].first_response_at > first_final
    assert_quiescent(server, "iterative_two_slots", NUM_BLOCKS, timeout_s=30)


def test_a_step_past_the_idle_timeout_ends_the_request_with_an_error_not_a_hang(server):
    """iterative_short_idle: max_sequence_idle_microseconds 400 ms, and steps made 600 ms slow. Rescheduling would
    fail inside Triton (its reaper released the slot) and the client would wait forever: the model ends the request
    with an error naming the setting instead."""
    client = StreamClient(server.grpc_url)
    try:
        client.send("iterative_short_idle", "slow", batched({"text_input": "Hello"})["text_input"],
                    batched({"max_tokens": 30, "ignore_eos": True, "stream": True}),
                    parameters={"inject_fault": "slow:ms=600,steps=1"})
        assert client.wait_finals(60), "no final: the client would hang"
        assert finals_problems([client]) == []
    finally:
        client.close()
    error = client.records["slow"].error
    assert error is not None and "max_sequence_idle_microseconds=400000" in error, error
    assert_quiescent(server, "iterative_short_idle", NUM_BLOCKS, timeout_s=30)
    good, err = stream(server.grpc_url, "iterative_short_idle", {"text_input": "Hello", "max_tokens": 4})
    assert err is None and text_of(good)  # fast steps are fine under the same timeout


def test_limit_inside_an_ensemble_a_cancel_does_not_reach_the_iterative_model(server):
    """An ensemble step works (Triton gives the composing request its own sequence), but Triton 2.51 does not pass a
    client's cancellation on to composing models: the request runs to its end (max_tokens) and frees its KV then."""
    done_before = counter(server, REQUEST_SUCCESS.name, "llm_iterative")
    length_before = scrape(server.metrics_url, "llm_iterative").get(LENGTH_FINISHES, 0)
    client = StreamClient(server.grpc_url)
    client.send("iterative_ensemble", "e", batched({"text_input": "Count: 1, 2,"})["text_input"],
                batched({"max_tokens": 60, "ignore_eos": True, "stream": True}))
    assert client.wait_responses("e", 2, timeout_s=60)
    client.close(cancel=True)
    deadline = time.monotonic() + 60
    while counter(server, REQUEST_SUCCESS.name, "llm_iterative") == done_before:
        assert time.monotonic() < deadline, "the composing request never finished"
        time.sleep(0.2)
    m = scrape(server.metrics_url, "llm_iterative")
    assert m.get(LENGTH_FINISHES, 0) - length_before == 1, "the cancelled request did not run to max_tokens"
    quiet(server)
    whole, err = stream(server.grpc_url, "iterative_ensemble", {"text_input": "Hello", "max_tokens": 6,
                                                                "stream": False, "ignore_eos": True})
    assert err is None and text_of(whole)


def test_the_config_swap_serves_llm_with_the_iterative_batcher(triton_server_factory, tmp_path):
    repo = tmp_path / "model_repository"
    copy_model(MODEL_REPOSITORY, "llm", repo, params=ENGINE)  # its configs/iterative.pbtxt goes along
    server = triton_server_factory(repo, ["--model-config-name=iterative"], env={"OMP_NUM_THREADS": "1"})
    got, err = stream(server.grpc_url, "llm", {"text_input": "The capital of France is", "max_tokens": 8,
                                               "temperature": 0.0, "ignore_eos": True, "stream": True})
    assert err is None and text_of(got)
    assert counter(server, "llm_iterative_executes_total", "llm") >= 8  # `llm` is the iterative model now
    assert_quiescent(server, "llm", NUM_BLOCKS, timeout_s=30)
