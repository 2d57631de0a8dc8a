"""The engine loop thread: finals on every path (finish, abort, engine error, shutdown), queue limits."""
import threading
import time

import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight import EngineConfig, FinishReason, InvalidRequestError, SamplingParams
from inflight.engine import EngineLoop, LLMEngine, QueueFullError


class Collector:
    def __init__(self):
        self.outputs = {}
        self.finals = {}
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)

    def __call__(self, outs):
        with self.lock:
            for out in outs:
                assert out.request_id not in self.finals, f"output after the final for {out.request_id}"
                self.outputs.setdefault(out.request_id, []).append(out)
                if out.finished:
                    self.finals[out.request_id] = out
            self.done.notify_all()

    def wait_finals(self, n, timeout=60):
        with self.lock:
            assert self.done.wait_for(lambda: len(self.finals) >= n, timeout), f"{len(self.finals)}/{n} finals"


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_queue_size=4, max_num_seqs=8))


def run_loop(engine, collector):
    loop = EngineLoop(engine, collector, idle_wait_s=0.01)
    loop.start()
    return loop


def test_requests_finish_and_abort_gets_a_cancelled_final(engine):
    col = Collector()
    loop = run_loop(engine, col)
    try:
        loop.add_request("short", "hello there", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        loop.add_request("long", "hello there", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        col.wait_finals(1)
        loop.abort_request("long")
        col.wait_finals(2)
        assert col.finals["short"].finish_reason == FinishReason.LENGTH
        assert sum(len(o.new_token_ids) for o in col.outputs["short"]) == 3
        assert col.finals["long"].finish_reason == FinishReason.CANCELLED
        assert sum(len(o.new_token_ids) for o in col.outputs["long"]) < 500
    finally:
        loop.stop()
    assert_pool_whole(engine)


def test_engine_error_fails_in_flight_requests_and_loop_recovers(engine):
    col = Collector()
    loop = run_loop(engine, col)
    calls = {"n": 0}

    def explode_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")

    engine.step_hook = explode_once
    try:
        for i in range(3):
            loop.add_request(f"r{i}", "tell me a story", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        col.wait_finals(3)
        assert all(f.finish_reason == FinishReason.ERROR and "injected fault" in f.error for f in col.finals.values())
        assert loop.num_engine_errors == 1
        assert_pool_whole(engine)
        loop.add_request("after", "hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        col.wait_finals(4)
        assert col.finals["after"].finish_reason == FinishReason.LENGTH
    finally:
        engine.step_hook = None
        loop.stop()
    assert_pool_whole(engine)


def test_stop_gives_every_in_flight_request_a_final(engine):
    col = Collector()
    loop = run_loop(engine, col)
    for i in range(4):
        loop.add_request(f"s{i}", "once upon a time", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    time.sleep(0.2)
    loop.stop()
    assert set(col.finals) == {f"s{i}" for i in range(4)}
    assert all(f.finish_reason == FinishReason.CANCELLED for f in col.finals.values())
    assert_pool_whole(engine)


def test_queue_limit_and_validation_errors_reach_only_the_caller(engine):
    col = Collector()
    loop = EngineLoop(engine, col)  # not started: everything stays queued
    with pytest.raises(InvalidRequestError, match="empty"):
        loop.add_request("bad", "", SamplingParams(max_tokens=2))
    for i in range(4):
        loop.add_request(f"q{i}", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="max_queue_size=4"):
        loop.add_request("q4", "hi", SamplingParams(max_tokens=2))  # shed before tokenizing
    assert engine.metrics.snapshot()["counters"]["queue_full_refusals_total"] == 1  # the dashboard's refusals
    loop.start()
    col.wait_finals(4)
    loop.stop()
    assert set(col.finals) == {f"q{i}" for i in range(4)}
    assert_pool_whole(engine)


def test_duplicate_request_id_is_refused_for_that_request_only(engine):
    col = Collector()
    loop = run_loop(engine, col)
    try:
        loop.add_request("dup", "hello", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        loop.add_request("dup", "hello", SamplingParams(max_tokens=2))
        deadline = time.time() + 30
        while time.time() < deadline:
            with col.lock:
                errors = [o for o in col.outputs.get("dup", []) if o.finish_reason == FinishReason.ERROR]
            if errors:
                break
            time.sleep(0.01)
        assert errors and "already in flight" in errors[0].error
    finally:
        loop.stop()
    assert_pool_whole(engine)
