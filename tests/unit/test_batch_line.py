"""dynamic_arm.BatchLine without Triton: execute() hands batches over and returns at once; a worker runs them as
static batches on the real engine (tiny-llama), joining the batches that waited the way Triton's dynamic batcher
takes its queue when an instance comes free; every request gets exactly one final, also when the model unloads."""
import threading
import time

import pytest

from engine_helpers import TINY, assert_pool_whole
from dynamic_arm.batch_line import UNLOADING, BatchLine, next_batch_size
from dynamic_arm.static_batch import StaticBatchRunner
from inflight import EngineConfig
from inflight.engine import LLMEngine
from test_static_batch import RecordingTransport, item


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_num_seqs=8, static_batching=True))


def test_next_batch_size_follows_the_dynamic_batchers_rule():
    preferred = [16, 32, 64]
    assert next_batch_size(3, 64, preferred) == 3  # no preferred size filled: all of them
    assert next_batch_size(20, 64, preferred) == 16  # the largest preferred size they fill
    assert next_batch_size(40, 64, preferred) == 32
    assert next_batch_size(100, 64, preferred) == 64  # never more than max_batch_size
    assert next_batch_size(10, 8, []) == 8


class GatedTransport(RecordingTransport):
    """Holds the sends for one request (the running batch's) until released, so a test can queue batches behind
    a running one."""

    def __init__(self, held: str):
        super().__init__()
        self.held = held
        self.gate = threading.Event()
        self.first_send = threading.Event()

    def send(self, sender, outputs, final, error=None):
        if sender == self.held:
            self.first_send.set()
            assert self.gate.wait(30), "gate never opened"
        super().send(sender, outputs, final, error)


def wait_for(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_submit_returns_at_once_and_waiting_batches_join_the_next_static_batch(engine):
    transport = GatedTransport("first")
    started = []
    line = BatchLine(StaticBatchRunner(engine, transport), max_batch_size=8, preferred=[4], on_batch=started.append)
    try:
        t0 = time.monotonic()
        line.submit([item(engine, "first", max_tokens=4, stream=True)])
        assert time.monotonic() - t0 < 0.5  # execute() is never held by a running batch
        assert transport.first_send.wait(30)  # the first batch runs and is stuck in its first send
        for k in range(3):  # three Triton batches arrive meanwhile: 1 + 2 + 3 requests
            line.submit([item(engine, f"b{k}-{j}", max_tokens=3) for j in range(k + 1)])
        assert line.num_waiting == 6
        transport.gate.set()
        wait_for(lambda: len(line.ran) == 3)
        # Six waited: the largest preferred size (4) first (batches 1 and 2 and the first of batch 3), then the
        # remaining two.
        assert list(line.ran) == [(1, 1), (3, 4), (1, 2)] and started == [1, 4, 2]
        names = ["first"] + [f"b{k}-{j}" for k in range(3) for j in range(k + 1)]
        for name in names:
            _, _, error = transport.final(name)
            assert error is None, (name, error)
        assert_pool_whole(engine)
    finally:
        transport.gate.set()
        line.close()


def test_close_ends_the_waiting_requests_with_one_cancelled_final_each(engine):
    transport = GatedTransport("running")
    line = BatchLine(StaticBatchRunner(engine, transport), max_batch_size=8)
    line.submit([item(engine, "running", max_tokens=3)])
    assert transport.first_send.wait(30)
    line.submit([item(engine, "waiting-1", max_tokens=3), item(engine, "waiting-2", max_tokens=3)])
    closer = threading.Thread(target=line.close)
    closer.start()
    wait_for(lambda: "waiting-2" in transport.sent)  # refused while the running batch is still held
    transport.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    for name in ("waiting-1", "waiting-2"):
        _, _, error = transport.final(name)
        assert error.code == "CANCELLED" and UNLOADING in error.message, error
    assert transport.final("running")[2] is None  # the running batch finished as the runner decided
    line.submit([item(engine, "late", max_tokens=3)])  # after close: refused, never run
    assert UNLOADING in transport.final("late")[2].message
    assert_pool_whole(engine)


def test_an_unloading_model_refuses_what_waits_behind_the_running_batch(engine):
    transport = GatedTransport("running")
    answers = iter([True] + [False] * 100)  # served once, then not: UnloadWatch sees the unload
    runner = StaticBatchRunner(engine, transport, is_serving=lambda: next(answers), serving_check_period_s=0.0)
    line = BatchLine(runner, max_batch_size=8)
    try:
        line.submit([item(engine, "running", max_tokens=50)])
        assert transport.first_send.wait(30)
        line.submit([item(engine, "behind", max_tokens=3)])
        transport.gate.set()
        wait_for(lambda: "behind" in transport.sent and "running" in transport.sent
                 and transport.sent["running"][-1][1])
        assert "the server is shutting down" in transport.final("running")[2].message
        assert UNLOADING in transport.final("behind")[2].message
        assert_pool_whole(engine)
    finally:
        line.close()
