"""The dynamic-batcher arm without Triton: StaticBatchRunner on the real engine (tiny-llama) and the internal
interface between the ensemble's steps. Every request gets exactly one final on every path."""
import subprocess
import sys
import time

import numpy as np
import pytest

from engine_helpers import ROOT, TINY, assert_pool_whole
from dynamic_arm.cancel_relay import CancelRelay, new_key
from dynamic_arm.interface import decode_request, encode_request, to_public_outputs
from dynamic_arm.static_batch import BatchItem, StaticBatchRunner
from inflight import EngineConfig, InvalidRequestError
from inflight.engine import LLMEngine
from serving.contract import parse_request


class RecordingTransport:
    """Records every send; touching a sender after its final fails the test (it crashes a real server)."""

    def __init__(self, cancel_after: dict[str, int] | None = None):
        self.sent: dict[str, list[tuple]] = {}
        self.cancel_after = cancel_after or {}  # sender -> cancelled once it has this many responses

    def send(self, sender, outputs, final, error=None):
        log = self.sent.setdefault(sender, [])
        assert not (log and log[-1][1]), f"{sender}: a send after the final"
        log.append((outputs, final, error))

    def is_cancelled(self, sender):
        log = self.sent.get(sender, [])
        assert not (log and log[-1][1]), f"{sender}: is_cancelled after the final"
        return sender in self.cancel_after and len(log) >= self.cancel_after[sender]

    def final(self, sender):
        finals = [entry for entry in self.sent[sender] if entry[1]]
        assert len(finals) == 1, f"{sender}: {len(finals)} finals"
        return finals[0]

    def text(self, sender) -> str:
        return "".join(o["text_output"][0].decode() for o, _, e in self.sent[sender] if e is None)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_num_seqs=8, static_batching=True))


def item(engine, name, prompt="Hello there, how are you?", **fields):
    req = parse_request({"text_input": np.array([prompt.encode()], dtype=np.object_)},
                        {"temperature": 0.0, **fields})
    return BatchItem(name, name, engine.tokenizer.encode(req.prompt), req)


def test_batch_runs_to_completion_with_one_final_each(engine):
    transport = RecordingTransport()
    runner = StaticBatchRunner(engine, transport)
    lengths = {"a": 3, "b": 9, "c": 17, "d": 5}
    items = [item(engine, n, max_tokens=k, stream=True, return_num_output_tokens=True) for n, k in lengths.items()]
    items.append(item(engine, "whole", max_tokens=17))  # same prompt as c, not streamed
    stats = runner.run(items)
    # One static batch: every request admitted together, so the batch lasts as long as its longest request.
    assert stats.num_admitted == 5 and stats.num_steps == 17
    for name, k in lengths.items():
        outputs, _, error = transport.final(name)
        assert error is None
        assert sum(int(o["num_output_tokens"][0]) for o, _, _ in transport.sent[name]) == k
    assert transport.text("c") == transport.text("whole")  # streamed text == non-streamed, byte for byte
    assert len(transport.sent["whole"]) == 1
    assert_pool_whole(engine)


def test_a_bad_request_costs_only_itself(engine):
    transport = RecordingTransport()
    runner = StaticBatchRunner(engine, transport)
    good = item(engine, "good", max_tokens=4)
    too_long = item(engine, "too_long", max_tokens=4)
    too_long.prompt_ids = too_long.prompt_ids * 1000  # past max_model_len
    bad_id = item(engine, "bad_id", max_tokens=4)
    bad_id.prompt_ids = [10**9]
    runner.run([too_long, good, bad_id])
    for name in ("too_long", "bad_id"):
        _, _, error = transport.final(name)
        assert error is not None and error.code == "INVALID_ARG"
    assert "max_model_len" in transport.final("too_long")[2].message
    assert transport.final("good")[2] is None and transport.text("good")
    assert_pool_whole(engine)


def test_cancellation_is_polled_every_step_and_frees_the_request(engine):
    transport = RecordingTransport(cancel_after={"quitter": 2})
    runner = StaticBatchRunner(engine, transport)
    stats = runner.run([item(engine, "quitter", max_tokens=30, stream=True),
                        item(engine, "stayer", max_tokens=12, stream=True)])
    _, _, error = transport.final("quitter")
    assert error is not None and error.code == "CANCELLED"
    assert len(transport.sent["quitter"]) == 3  # two data responses, then the cancelled final
    assert transport.final("stayer")[2] is None
    assert stats.num_steps == 12  # the batch no longer waits for the cancelled 30-token request
    assert_pool_whole(engine)


class PostingTransport(RecordingTransport):
    """Plays postprocessing's part: after a row's post_after-th response, the client cancels the ensemble and the
    next postprocessing call posts the row's key (the `row_key` output) to the relay."""

    def __init__(self, relay: CancelRelay, post_after: dict[str, int]):
        super().__init__()
        self.relay, self.post_after = relay, post_after

    def send(self, sender, outputs, final, error=None):
        super().send(sender, outputs, final, error)
        if outputs is not None and len(self.sent[sender]) == self.post_after.get(sender):
            assert self.relay.post(outputs["row_key"][0].decode())


def test_a_cancel_relayed_from_postprocessing_aborts_only_that_row(engine, tmp_path):
    relay = CancelRelay(tmp_path / "relay")
    transport = PostingTransport(relay, post_after={"quitter": 2})
    runner = StaticBatchRunner(engine, transport, relay=relay)
    items = [item(engine, "quitter", max_tokens=30, stream=True, return_finish_reason=True),
             item(engine, "stayer", max_tokens=12, stream=True)]
    for it in items:
        it.row_key = new_key()
    stats = runner.run(items)
    assert stats.relayed_cancels == 1
    # A final data response, not an error: an ensemble step that fails while another streams hangs Triton 2.51.
    outputs, _, error = transport.final("quitter")
    assert error is None and outputs["finish_reason"].tolist() == [b"cancelled"]
    assert len(transport.sent["quitter"]) == 3  # two data responses, then the final
    assert transport.final("stayer")[2] is None and stats.num_steps == 12  # the batch stops waiting for 30
    for it in items:  # every data response carries its own row's key
        keys = {o["row_key"][0].decode() for o, _, e in transport.sent[it.client_id] if e is None}
        assert keys == {it.row_key}
    assert list(relay.directory.iterdir()) == []  # the batch cleared its posts
    assert_pool_whole(engine)


def test_an_engine_fault_fails_the_batch_with_finals_and_the_next_batch_works(engine):
    transport = RecordingTransport()
    runner = StaticBatchRunner(engine, transport)
    calls = []

    def fault():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")

    engine.step_hook = fault
    try:
        runner.run([item(engine, f"f{i}", max_tokens=8, stream=True) for i in range(3)])
    finally:
        engine.step_hook = None
    for i in range(3):
        _, _, error = transport.final(f"f{i}")
        assert error is not None and error.code == "INTERNAL" and "injected" in error.message
    assert_pool_whole(engine)
    runner.run([item(engine, "after", max_tokens=3)])
    assert transport.final("after")[2] is None


def test_unloading_cancels_the_running_batch(engine):
    transport = RecordingTransport()
    answers = iter([True])  # served once, then no longer: two "not ready" answers in a row mean unloading
    runner = StaticBatchRunner(engine, transport, is_serving=lambda: next(answers, False), serving_check_period_s=0.0)
    runner.run([item(engine, "x", max_tokens=50), item(engine, "y", max_tokens=50, stream=True)])
    for name in ("x", "y"):
        error = transport.final(name)[2]
        assert error is not None and "shutting down" in error.message
    assert_pool_whole(engine)


def test_optional_outputs_only_when_asked_and_only_an_unstreamed_answer_echoes_the_prompt(engine):
    transport = RecordingTransport()
    runner = StaticBatchRunner(engine, transport)
    runner.run([item(engine, "plain", max_tokens=3, stream=True),
                item(engine, "all", max_tokens=3, stream=True,
                     return_finish_reason=True, return_num_input_tokens=True, return_logprobs=True),
                item(engine, "echo", max_tokens=3, exclude_input_in_output=False)])
    assert all(set(o) == {"output_ids", "text_output"} for o, _, _ in transport.sent["plain"])
    responses = [o for o, _, _ in transport.sent["all"]]
    assert not any(o["text_output"][0].decode().startswith("Hello there") for o in responses)  # a stream never echoes
    echoed = [o for o, _, _ in transport.sent["echo"]]
    assert len(echoed) == 1 and echoed[0]["text_output"][0].decode().startswith("Hello there, how are you?")
    assert [o["finish_reason"][0] for o in responses] == [b"None"] * (len(responses) - 1) + [b"length"]
    assert all({"num_input_tokens", "logprobs"} <= set(o) for o in responses)


def test_runner_refuses_an_in_flight_engine():
    class NotStatic:
        config = EngineConfig(model=TINY)
    with pytest.raises(ValueError, match="static_batching"):
        StaticBatchRunner(NotStatic(), RecordingTransport())


def test_request_config_round_trips_every_field():
    req = parse_request({"text_input": np.array([b"Hi"], dtype=np.object_),
                         "stop_words": np.array([b"end", b"stop"], dtype=np.object_)},
                        {"max_tokens": "7", "temperature": 0.5, "top_k": 3, "seed": 2**63, "stream": False,
                         "exclude_input_in_output": False, "return_logprobs": True, "priority": -2,
                         "bad_words": ["x"]})
    back, arrival = decode_request(encode_request(req, arrival_unix=time.time() - 2.0))
    assert back == req  # including the prompt, echoed because exclude_input_in_output=False
    assert 1.5 < time.monotonic() - arrival < 3.0  # the arrival, moved onto this process's monotonic clock
    plain = parse_request({"text_input": np.array([b"Hi"], dtype=np.object_)})
    assert decode_request(encode_request(plain))[0].prompt == ""


@pytest.mark.parametrize("raw, match", [
    (b"{not json", "not JSON"),
    (b'{"stream": true}', "malformed"),
    (b'{"params": {"max_tokens": 4, "bogus": 1}}', "bogus"),
    (b'{"params": {"max_tokens": 0}}', "max_tokens"),
])
def test_request_config_refuses_what_preprocessing_never_sends(raw, match):
    with pytest.raises(InvalidRequestError, match=match):
        decode_request(raw)


def test_postprocessing_maps_to_llm_shapes_and_checks_counts():
    out = to_public_outputs({"output_ids": np.array([[5, 6]], dtype=np.int32),
                             "text_output": np.array([["é b".encode()]], dtype=np.object_),
                             "num_output_tokens": np.array([[2]], dtype=np.uint32)})
    assert out["text_output"].shape == (1,) and out["text_output"][0] == "é b".encode()
    assert out["num_output_tokens"].tolist() == [2] and "finish_reason" not in out
    with pytest.raises(ValueError, match="num_output_tokens"):
        to_public_outputs({"output_ids": np.array([[5]], dtype=np.int32),
                           "text_output": np.array([[b"x"]], dtype=np.object_),
                           "num_output_tokens": np.array([[2]], dtype=np.uint32)})
    with pytest.raises(ValueError):
        to_public_outputs({"output_ids": np.array([[5]], dtype=np.int32),
                           "text_output": np.array([[b"\xc3"]], dtype=np.object_)})


def test_generated_configs_match_the_request_schema():
    done = subprocess.run([sys.executable, "scripts/gen_configs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
