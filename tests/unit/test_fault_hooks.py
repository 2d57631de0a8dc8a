"""The fault hooks (tests/fault_hooks.py, a serving.request_hooks hook) and the frontend's unload detection, on
the tiny engine with a recording transport: injected engine errors end every in-flight request once, the engine serves
again afterwards, and a host that stops saying "ready" gets every in-flight request cancelled."""
import threading
import time

import numpy as np
import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from serving.errors import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE
import fault_hooks
from fault_hooks import FaultInjector, InjectedFault, parse_fault
from serving.frontend import InflightFrontend
from serving.options import parse_model_parameters
from serving.request_hooks import RequestHook, load_request_hook


class Sender:
    def __init__(self):
        self.events = []  # (outputs, final, error)
        self.done = threading.Event()


class Transport:
    def __init__(self):
        self.after_final = 0

    def send(self, sender, outputs, final, error=None):
        if sender.done.is_set():
            self.after_final += 1
        sender.events.append((outputs, final, error))
        if final:
            sender.done.set()

    def is_cancelled(self, sender):
        if sender.done.is_set():
            self.after_final += 1
        return False


def inputs(prompt, max_tokens):
    return {"text_input": np.array([prompt.encode()], dtype=np.object_),
            "max_tokens": np.array([max_tokens], dtype=np.int32), "ignore_eos": np.array([True])}


def final_error(sender):
    (outputs, final, error), = [e for e in sender.events if e[1]]
    return error


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_model_len=256))


@pytest.mark.parametrize("raw,kind,values", [
    ("error", "error", {"after": 1}),
    ("error:after=5", "error", {"after": 5}),
    (" slow:ms=20,steps=3 ", "slow", {"ms": 20, "steps": 3}),
])
def test_fault_specs_parse(raw, kind, values):
    spec = parse_fault(raw)
    assert (spec.kind, spec.values) == (kind, values)


@pytest.mark.parametrize("raw,needle", [
    ("boom", "inject_fault='boom'"), ("", "inject_fault=''"), (3, "inject_fault=3"),
    ("error:after=0", "after='0' is out of range: allowed [1, 100000]"),
    ("slow:ms=50", "lacks steps="), ("slow:ms=x,steps=2", "ms='x'"), ("error:when=1", "unknown key 'when'"),
    ("slow:ms=99999,steps=1", "allowed [1, 10000]"),
])
def test_bad_fault_specs_name_the_value(raw, needle):
    with pytest.raises(InvalidRequestError) as info:
        parse_fault(raw)
    assert needle in str(info.value)


def test_the_hook_module_loads_by_name_and_the_product_ships_none(tmp_path):
    assert load_request_hook("") is None and load_request_hook("  ") is None
    hook = load_request_hook(fault_hooks.ON["request_hook_module"])
    assert isinstance(hook, FaultInjector) and isinstance(hook, RequestHook) and hook.parameter == "inject_fault"
    assert parse_model_parameters({"model": TINY, **fault_hooks.ON}, tmp_path).request_hook_module == "fault_hooks"
    assert parse_model_parameters({"model": TINY}, tmp_path).request_hook_module == ""
    with pytest.raises(ValueError, match="request_hook_module='no_such_hooks' cannot be imported"):
        load_request_hook("no_such_hooks")
    with pytest.raises(ValueError, match="has no make_request_hook"):
        load_request_hook("engine_helpers")


def test_injector_fires_once_on_the_nth_step_and_sleeps_while_slow():
    hook = FaultInjector()
    hook()  # disarmed: nothing happens
    hook.arm(parse_fault("error:after=3"))
    hook(), hook()
    with pytest.raises(InjectedFault):
        hook()
    hook()  # fired once only
    hook.arm(parse_fault("slow:ms=30,steps=2"))
    t0 = time.monotonic()
    hook(), hook()
    assert time.monotonic() - t0 >= 0.06
    t0 = time.monotonic()
    hook()
    assert time.monotonic() - t0 < 0.03
    assert hook.num_faults == 1


def test_injected_engine_error_ends_every_request_once_and_the_engine_recovers(engine):
    transport = Transport()
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02, request_hook=FaultInjector())
    fe.start()
    try:
        victims = [Sender() for _ in range(4)]
        for i, s in enumerate(victims):
            fe.submit(s, f"v{i}", inputs("A long one", 200), {"inject_fault": "slow:ms=5,steps=1000"} if i == 0 else {})
        trigger = Sender()
        fe.submit(trigger, "t", inputs("Trigger", 200), {"inject_fault": "error:after=3"})
        for s in victims + [trigger]:
            assert s.done.wait(60)
            error = final_error(s)
            assert error is not None and error.code == INTERNAL and "InjectedFault" in error.message
        fe.request_hook.arm(parse_fault("slow:ms=1,steps=1"))  # end the slow phase early
        after = Sender()
        fe.submit(after, "after", inputs("Fine again", 5))
        assert after.done.wait(60) and final_error(after) is None
        bad = Sender()
        fe.submit(bad, "bad", inputs("x", 5), {"inject_fault": "boom"})
        assert bad.done.wait(5) and final_error(bad).code == INVALID_ARG
    finally:
        fe.close()
        engine.step_hook = None
    assert transport.after_final == 0 and fe.num_inflight == 0
    assert_pool_whole(engine)


def test_without_hooks_inject_fault_is_an_unknown_parameter(engine):
    fe = InflightFrontend(engine, Transport(), cancel_check_period_s=0.02)
    fe.start()
    try:
        s = Sender()
        fe.submit(s, "x", inputs("Hi", 3), {"inject_fault": "error"})
        assert s.done.wait(5)
        assert "request parameter 'inject_fault' is unknown" in final_error(s).message
    finally:
        fe.close()
    assert engine.step_hook is None


def test_host_not_ready_cancels_in_flight_requests_and_refuses_new_ones(engine):
    engine.step_hook = FaultInjector()
    engine.step_hook.arm(parse_fault("slow:ms=10,steps=100000"))
    ready = {"value": False}
    answers = []

    def is_ready():
        answers.append(ready["value"])
        return ready["value"]

    transport = Transport()
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02, is_ready=is_ready, ready_check_period_s=0.02)
    fe.start()
    try:
        early = Sender()  # not ready before ever being ready (loading): nothing is cancelled
        fe.submit(early, "early", inputs("Before ready", 3))
        assert early.done.wait(30) and final_error(early) is None
        ready["value"] = True
        senders = [Sender() for _ in range(3)]
        for i, s in enumerate(senders):
            fe.submit(s, f"s{i}", inputs("Long running", 200))
        time.sleep(0.2)
        assert not any(s.done.is_set() for s in senders)
        ready["value"] = False
        for s in senders:
            assert s.done.wait(10)
            error = final_error(s)
            assert error.code == CANCELLED and "the model is being unloaded" in error.message
        late = Sender()
        fe.submit(late, "late", inputs("Too late", 3))
        assert late.done.wait(5) and final_error(late).code == UNAVAILABLE
    finally:
        fe.close()
        engine.step_hook = None
    assert True in answers and transport.after_final == 0
    assert_pool_whole(engine)
