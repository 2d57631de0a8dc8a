"""The decoupled frontend (backend_src/serving/frontend.py) on the real tiny engine, with a recording
transport in place of Triton's response senders: one final per request on every path, never a touch
after FINAL, streamed deltas that add up to the non-streamed text, cancellation and shutdown."""
import threading
import time

import numpy as np
import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from serving.errors import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE
from serving.frontend import InflightFrontend


class Sender:
    def __init__(self, name):
        self.name = name
        self.cancelled = False
        self.events = []  # (outputs, final, error)
        self.done = threading.Event()


class RecordingTransport:
    """Fails the test (via .violations) on any touch of a sender after its FINAL."""

    def __init__(self):
        self.violations = []
        self.lock = threading.Lock()

    def send(self, sender, outputs, final, error=None):
        with self.lock:
            if sender.done.is_set():
                self.violations.append(f"send after FINAL on {sender.name}")
            sender.events.append((outputs, final, error))
            if final:
                sender.done.set()

    def is_cancelled(self, sender):
        if sender.done.is_set():
            self.violations.append(f"is_cancelled after FINAL on {sender.name}")
        return sender.cancelled


class FlakyTransport(RecordingTransport):
    """Raises once, on the first final sent to `fail_final_of` (the client went away, or Triton refused it)."""

    def __init__(self, fail_final_of: str):
        super().__init__()
        self.fail_final_of = fail_final_of

    def send(self, sender, outputs, final, error=None):
        if final and sender.name == self.fail_final_of:
            self.fail_final_of = None
            raise RuntimeError("injected: the response sender is gone")
        super().send(sender, outputs, final, error)


def text_of(sender):
    return "".join(o["text_output"][0].decode("utf-8") for o, _, e in sender.events if o is not None)


def request(prompt, **fields):
    inputs = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    for name, value in fields.items():
        if isinstance(value, bool):
            inputs[name] = np.array([value], dtype=np.bool_)
        elif isinstance(value, int):
            inputs[name] = np.array([value], dtype=np.int32)
        elif isinstance(value, float):
            inputs[name] = np.array([value], dtype=np.float32)
        else:
            inputs[name] = np.array([value.encode()], dtype=np.object_)
    return inputs


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_model_len=256, max_queue_size=4,
                                  max_prompt_bytes=4096))


@pytest.fixture
def frontend(engine):
    transport = RecordingTransport()
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02)
    fe.start()
    yield fe
    fe.close()
    assert transport.violations == []
    assert fe.num_inflight == 0
    assert_pool_whole(engine)


def wait(*senders, timeout=60):
    for s in senders:
        assert s.done.wait(timeout), f"{s.name} got no final"


def finals(sender):
    return [e for e in sender.events if e[1]]


def test_stream_deltas_equal_the_whole_text_and_final_rides_on_data(frontend):
    prompt = "你好，世界 😀 and emoji 🎉"
    a, b = Sender("stream"), Sender("whole")
    common = dict(max_tokens=12, ignore_eos=True, temperature=0.0, return_num_output_tokens=True,
                  return_finish_reason=True, return_num_input_tokens=True)
    frontend.submit(a, "a", request(prompt, stream=True, **common))
    frontend.submit(b, "b", request(prompt, **common))
    wait(a, b)
    assert len(finals(a)) == 1 and len(finals(b)) == 1 and len(b.events) == 1
    assert text_of(a) == text_of(b) and text_of(b)
    # No empty non-final responses; the last response carries data and the FINAL flag.
    assert all(o["text_output"][0] for o, final, _ in a.events if not final)
    last_outputs, last_final, last_error = a.events[-1]
    assert last_final and last_error is None and "text_output" in last_outputs
    # Per-response token counts add up to the total; finish_reason only on the final.
    assert sum(int(o["num_output_tokens"][0]) for o, _, _ in a.events) == 12
    assert int(b.events[0][0]["num_output_tokens"][0]) == 12
    # finish_reason on every response, "None" until the last (vLLM's backend does the same).
    assert [o["finish_reason"][0] for o, _, _ in a.events] == [b"None"] * (len(a.events) - 1) + [b"length"]
    assert b.events[0][0]["finish_reason"][0] == b"length"
    assert b.events[0][0]["num_input_tokens"][0] == a.events[0][0]["num_input_tokens"][0] > 0


def test_only_requested_outputs_are_attached(frontend):
    s = Sender("plain")
    frontend.submit(s, "", request("Hello", max_tokens=3, ignore_eos=True))
    wait(s)
    assert set(s.events[0][0]) == {"text_output"}


def test_prompt_leads_a_whole_output_when_not_excluded_but_never_a_stream(frontend):
    """Both peers: exclude_input_in_output=false echoes the prompt in a non-streamed response; a stream never
    repeats it (with the model's default false; asked for explicitly, vLLM's backend refuses it, and so do we)."""
    a, b, c = Sender("stream"), Sender("whole"), Sender("plain")
    common = dict(max_tokens=4, ignore_eos=True, temperature=0.0)
    frontend.request_defaults = {"exclude_input_in_output": False}
    frontend.submit(a, "", request("Hello there", stream=True, **common))
    frontend.submit(b, "", request("Hello there", **common))
    frontend.request_defaults = {}
    frontend.submit(c, "", request("Hello there", max_tokens=4, ignore_eos=True, temperature=0.0))
    wait(a, b, c)
    assert text_of(b) == "Hello there" + text_of(c) and text_of(a) == text_of(c)
    assert not a.events[0][0]["text_output"][0].decode().startswith("Hello there")


def test_the_models_default_for_exclude_input_in_output(engine):
    transport = RecordingTransport()
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02,
                          request_defaults={"exclude_input_in_output": False})  # vLLM's and TensorRT-LLM's
    fe.start()
    try:
        echoed, plain = Sender("echoed"), Sender("plain")
        fe.submit(echoed, "", request("Hello there", max_tokens=3, ignore_eos=True, temperature=0.0))
        fe.submit(plain, "", request("Hello there", max_tokens=3, ignore_eos=True, temperature=0.0,
                                     exclude_input_in_output=True))
        wait(echoed, plain)
        assert text_of(echoed) == "Hello there" + text_of(plain)
    finally:
        fe.close()


def test_bad_requests_get_one_error_each_and_good_ones_complete(frontend):
    good = Sender("good")
    frontend.submit(good, "g", request("Hello", max_tokens=6, ignore_eos=True, stream=True))
    bad = {
        "missing": ({"max_tokens": np.array([3], dtype=np.int32)}, "text_input"),
        "empty": (request(""), "text_input=''"),
        "temperature": (request("Hi", temperature=-1.0), "temperature=-1.0"),
        "json": (request("Hi", sampling_parameters="{oops"), "sampling_parameters"),
        "too_long": (request("word " * 300, max_tokens=10), "max_model_len=256"),
        "prompt_bytes": (request("x" * 5000), "at most 4096 bytes"),
    }
    senders = {}
    for name, (inputs, _) in bad.items():
        senders[name] = Sender(name)
        frontend.submit(senders[name], name, inputs)
    for name, (_, needle) in bad.items():
        s = senders[name]
        wait(s)
        assert len(s.events) == 1
        outputs, final, error = s.events[0]
        assert final and outputs is None and error.code == INVALID_ARG and needle in error.message
    wait(good)
    assert finals(good)[0][2] is None and text_of(good)


def test_duplicate_client_ids_are_kept_apart(frontend):
    a, b = Sender("a"), Sender("b")
    frontend.submit(a, "same", request("One", max_tokens=3, ignore_eos=True, return_num_output_tokens=True))
    frontend.submit(b, "same", request("Two two", max_tokens=5, ignore_eos=True, return_num_output_tokens=True))
    wait(a, b)
    assert int(a.events[0][0]["num_output_tokens"][0]) == 3
    assert int(b.events[0][0]["num_output_tokens"][0]) == 5


def test_client_cancellation_gives_a_cancelled_final_and_frees_blocks(frontend, engine):
    s = Sender("long")
    frontend.submit(s, "long", request("Go", max_tokens=200, ignore_eos=True, stream=True))
    deadline = time.monotonic() + 30
    while len(s.events) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.cancelled = True
    wait(s)
    outputs, final, error = s.events[-1]
    assert final and error.code == CANCELLED and "cancelled by the client" in error.message
    assert len(s.events) < 200


def test_trtllm_stop_flag_cancels_requests_with_that_id(frontend):
    target, other, stopper = Sender("target"), Sender("other"), Sender("stopper")
    frontend.submit(target, "victim", request("Go", max_tokens=200, ignore_eos=True, stream=True))
    frontend.submit(other, "bystander", request("Go", max_tokens=8, ignore_eos=True))
    while not target.events:
        time.sleep(0.01)
    frontend.submit(stopper, "victim", request(""), {"stop": True})
    wait(target, other, stopper)
    assert stopper.events == [({"text_output": stopper.events[0][0]["text_output"]}, True, None)]
    assert target.events[-1][2].code == CANCELLED and "stop request" in target.events[-1][2].message
    assert other.events[-1][2] is None


def test_a_stop_requests_failed_final_costs_that_request_only(engine):
    """model.py's execute submits its requests one by one: a stop request whose empty final cannot be sent must not
    raise out of submit (the requests after it in that execute would never be handed over)."""
    transport = FlakyTransport(fail_final_of="stopper")
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02)
    fe.start()
    try:
        target, other, stopper, later = Sender("target"), Sender("other"), Sender("stopper"), Sender("later")
        fe.submit(target, "victim", request("Go", max_tokens=200, ignore_eos=True, stream=True))
        fe.submit(other, "bystander", request("Go", max_tokens=8, ignore_eos=True))
        while not target.events:
            time.sleep(0.01)
        fe.submit(stopper, "victim", request(""), {"stop": True})
        fe.submit(later, "later", request("Go", max_tokens=5, ignore_eos=True))
        wait(target, other, stopper, later)
        assert target.events[-1][2].code == CANCELLED and "stop request" in target.events[-1][2].message
        assert len(finals(other)) == 1 and other.events[-1][2] is None and text_of(other)
        assert len(finals(later)) == 1 and later.events[-1][2] is None and text_of(later)
        assert len(finals(stopper)) == 1 and stopper.events[-1][2].code == INTERNAL  # its one final, after the failed
    finally:
        fe.close()
    assert transport.violations == [] and fe.num_inflight == 0
    assert_pool_whole(engine)


def test_queue_full_is_unavailable(engine):
    transport = RecordingTransport()
    fe = InflightFrontend(engine, transport)  # not started: nothing leaves the queue
    senders = [Sender(f"q{i}") for i in range(6)]
    for s in senders:
        fe.submit(s, s.name, request("Hi", max_tokens=2))
    refused = [s for s in senders if s.events]
    assert len(refused) == 2  # max_queue_size=4
    for s in refused:
        (outputs, final, error), = s.events
        assert final and error.code == UNAVAILABLE and "max_queue_size=4" in error.message
    fe.start()
    fe.close()
    # close() ends whatever it finds: every request has exactly one final, no touch after it.
    assert all(len(finals(s)) == 1 for s in senders) and transport.violations == []
    assert_pool_whole(engine)


def test_close_ends_every_inflight_request_and_later_requests_are_refused(engine):
    transport = RecordingTransport()
    fe = InflightFrontend(engine, transport)
    fe.start()
    senders = [Sender(f"s{i}") for i in range(3)]
    for s in senders:
        fe.submit(s, s.name, request("Go on", max_tokens=200, ignore_eos=True, stream=True))
    while not all(s.events for s in senders):
        time.sleep(0.01)
    fe.close()
    for s in senders:
        assert len(finals(s)) == 1
        assert s.events[-1][2].code == CANCELLED and "shutting down" in s.events[-1][2].message
    late = Sender("late")
    fe.submit(late, "late", request("Hi", max_tokens=2))
    assert late.events[0][2].code == UNAVAILABLE
    assert transport.violations == []
    assert_pool_whole(engine)


@pytest.mark.parametrize("cancel", [False, True])
def test_no_sender_is_kept_alive_after_its_final(frontend, cancel):
    """Triton 2.51 keeps a decoupled model loaded while any of its response senders is alive (each holds a
    response factory). A sender the frontend still references after its final, e.g. from a thread's
    leftover local, blocks unloading and shutdown for good, so every reference must go with the final."""
    import gc
    import weakref
    sender = Sender("held")
    frontend.submit(sender, "held", request("Hello there", max_tokens=40, stream=True))
    time.sleep(0.1)  # several cancellation polls while it runs: the poller has looked at its entry
    if cancel:
        sender.cancelled = True
    assert sender.done.wait(30)
    time.sleep(0.1)  # the poller's next rounds, now with nothing in flight
    ref = weakref.ref(sender)
    del sender
    # No gc.collect() before the check: an idle stub allocates little, so its cycle collector may not
    # run for a long time; reference counting alone must free the sender.
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
