"""The iterative-sequence arm without Triton: IterativeStepRunner on the real engine (tiny-llama), driven the way
Triton 2.51's iterative sequence batcher drives execute() (a new sender per execute, NULL requests padding slots,
requests held back, cancelled between executes). One engine step per execute over exactly the handed requests,
exactly one final per request on every path, and the KV pool whole afterwards."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight import EngineConfig
from inflight.engine import LLMEngine
from iterative_arm.step_runner import HandedRequest, IterativeStepRunner


@dataclass(frozen=True)
class Sender:
    """A response sender of one execute: Triton makes a new one per request per execute."""
    client: str
    execute: int


@dataclass
class Client:
    name: str
    inputs: dict
    parameters: dict = field(default_factory=dict)
    sent: list = field(default_factory=list)  # (outputs, final, error, sender)
    cancelled: bool = False
    request_id: str | None = None  # the id the client sends (default: its name)


class FakeTriton:
    """Triton's side: correlation ids, start flags, a new sender per execute, rescheduling, and a transport that
    fails the test when a sender is used after its client's final or a stale sender of a live sequence is used
    (also listed in .violations: the runner logs and swallows what a send raises)."""

    def __init__(self):
        self.clients: dict[str, Client] = {}
        self.cids: dict[str, int] = {}
        self.started: set[str] = set()
        self.queued: set[str] = set()  # rescheduled: in a slot, waiting for the next execute
        self.num_executes = 0
        self.current: dict[str, Sender] = {}  # the newest sender of each client
        self.violations: list[str] = []

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)
            raise AssertionError(message)

    # -- the transport the runner talks through --
    def send(self, sender, outputs, final, error=None):
        client = self.clients[sender.client]
        self._check(not any(s[1] for s in client.sent), f"{sender.client}: a send after the final")
        self._check(sender == self.current[sender.client], f"{sender.client}: a send on a stale sender")
        client.sent.append((outputs, final, error, sender))

    def is_cancelled(self, sender):
        client = self.clients[sender.client]
        self._check(not any(s[1] for s in client.sent), f"{sender.client}: is_cancelled after the final")
        return client.cancelled

    # -- the client side --
    def submit(self, name: str, prompt: str = "Hello there, how are you?", parameters: dict | None = None,
               **fields) -> None:
        inputs = {"text_input": np.array([[prompt.encode()]], dtype=np.object_)}
        for key, value in fields.items():
            dtype = {bool: np.bool_, int: np.int32, float: np.float32}[type(value)]
            inputs[key] = np.array([[value]], dtype=dtype)
        self.clients[name] = Client(name, inputs, parameters or {})
        self.cids[name] = len(self.cids) + 1
        self.queued.add(name)

    def final(self, name: str):
        finals = [s for s in self.clients[name].sent if s[1]]
        assert len(finals) == 1, f"{name}: {len(finals)} finals"
        return finals[0]

    def text(self, name: str) -> str:
        return "".join(o["text_output"][0].decode() for o, _, e, _ in self.clients[name].sent if e is None)

    # -- one execute --
    def handed(self, names: list[str | None]) -> list[HandedRequest]:
        """Requests in slot order; None is a NULL request."""
        self.num_executes += 1
        out = []
        for name in names:
            if name is None:
                out.append(HandedRequest(0, False, "", None, lambda: ({}, {})))
                continue
            client = self.clients[name]
            sender = self.current[name] = Sender(name, self.num_executes)
            start = name not in self.started
            self.started.add(name)
            out.append(HandedRequest(self.cids[name], start, client.request_id or name, sender,
                                     lambda c=client: (c.inputs, c.parameters)))
        return out

    def execute(self, runner: IterativeStepRunner, names: list[str | None] | None = None):
        names = sorted(self.queued) if names is None else names
        handed = self.handed(names)
        reschedule, stats = runner.execute(handed)
        for request, again in zip(handed, reschedule):
            if request.correlation_id:
                name = request.sender.client
                if again:
                    assert not any(s[1] for s in self.clients[name].sent), f"{name}: rescheduled after its final"
                    self.queued.add(name)
                else:
                    self.queued.discard(name)
        return reschedule, stats

    def run(self, runner: IterativeStepRunner, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.queued:
                return
            self.execute(runner)
        raise AssertionError(f"still queued after {limit} executes: {sorted(self.queued)}")


class FlakyTriton(FakeTriton):
    """FakeTriton whose transport raises once, on the first final sent to `fail_final_of` (the client went away, or
    Triton refused the response): that costs that request only."""

    def __init__(self, fail_final_of: str):
        super().__init__()
        self.fail_final_of: str | None = fail_final_of

    def send(self, sender, outputs, final, error=None):
        if final and sender.client == self.fail_final_of:
            self.fail_final_of = None
            raise RuntimeError("injected: the response sender is gone")
        super().send(sender, outputs, final, error)


class FailingHook:
    """A request hook (serving.request_hooks) whose apply raises: a bug inside execute, past the request guards."""
    parameter = "fail_execute"

    def attach(self, engine) -> None:
        pass

    def parse(self, raw):
        return raw

    def apply(self, parsed) -> None:
        raise RuntimeError("injected: a bug in execute")


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64))


_made: list[FakeTriton] = []


@pytest.fixture(autouse=True)
def no_transport_violations():
    """What the fake transport refused, the runner logged and swallowed: fail the test that caused it."""
    _made.clear()
    yield
    assert [v for triton in _made for v in triton.violations] == []


def make(engine, triton: FakeTriton, **kwargs) -> IterativeStepRunner:
    _made.append(triton)
    return IterativeStepRunner(engine, triton, **kwargs)


def reference_texts(engine, prompts: dict[str, tuple[str, int]]) -> dict[str, str]:
    """The same requests through the engine's own scheduling (the in-flight arm's loop)."""
    from inflight.sequence import SamplingParams
    for name, (prompt, n) in prompts.items():
        engine.add_request(f"ref-{name}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    texts = {name: "" for name in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id.removeprefix("ref-")] += out.text_delta
    assert_pool_whole(engine)
    return texts


def test_every_request_gets_one_final_and_the_text_of_the_engines_own_scheduling(engine):
    prompts = {"a": ("The capital of France is", 3), "b": ("1, 2, 3, 4,", 11), "c": ("Café au lait ☕", 7)}
    expected = reference_texts(engine, prompts)
    triton = FakeTriton()
    runner = make(engine, triton)
    for name, (prompt, n) in prompts.items():
        triton.submit(name, prompt, max_tokens=n, temperature=0.0, ignore_eos=True, stream=True)
    triton.run(runner)
    for name in prompts:
        outputs, _, error, _ = triton.final(name)
        assert error is None
        assert triton.text(name) == expected[name] and expected[name]
    assert runner.num_live == 0
    assert_pool_whole(engine)


def test_one_engine_step_per_execute_over_exactly_the_handed_requests(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    for name in ("a", "b"):
        triton.submit(name, max_tokens=12, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner, ["a", "b"])  # both prefill and sample their first token
    seq_b = engine.seqs[runner.sequences[triton.cids["b"]].live.internal_id]
    held_tokens, held_blocks = seq_b.num_output_tokens, list(seq_b.block_table)
    steps_before = engine.metrics.snapshot()["histograms"]["step_time_seconds"]["count"]
    for _ in range(4):  # b is held back (Triton put a NULL in its slot): it must not move, nor lose its KV
        reschedule, stats = triton.execute(runner, ["a", None])
        assert reschedule == [True, False] and stats.num_null == 1 and stats.num_absent == 1
    assert engine.metrics.snapshot()["histograms"]["step_time_seconds"]["count"] == steps_before + 4
    assert seq_b.num_output_tokens == held_tokens and seq_b.block_table == held_blocks
    assert engine.seqs[runner.sequences[triton.cids["a"]].live.internal_id].num_output_tokens == held_tokens + 4
    triton.run(runner)
    assert triton.final("a")[2] is None and triton.final("b")[2] is None
    assert triton.text("a") == triton.text("b")  # same prompt, greedy: holding b back changed nothing
    assert_pool_whole(engine)


def test_a_client_cancelled_between_executes_frees_its_kv_and_is_never_answered_again(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("gone", max_tokens=40, temperature=0.0, ignore_eos=True, stream=True)
    triton.submit("stays", max_tokens=6, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)
    triton.execute(runner)
    sent_before = len(triton.clients["gone"].sent)
    triton.clients["gone"].cancelled = True  # Triton answers it CANCELLED itself and never hands it in again
    triton.queued.discard("gone")
    _, stats = triton.execute(runner)
    assert stats.num_cancelled_between == 1 and triton.cids["gone"] not in runner.sequences
    triton.run(runner)
    assert len(triton.clients["gone"].sent) == sent_before  # Triton's CANCELLED was its final: nothing from us
    assert triton.final("stays")[2] is None
    assert_pool_whole(engine)


def test_a_request_cancelled_during_an_execute_is_answered_by_triton_at_the_next(engine):
    """We reschedule it (its sender said nothing yet); Triton cancels it in its queue; it never comes back."""
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("x", max_tokens=30, temperature=0.0, ignore_eos=True, stream=True)
    reschedule, _ = triton.execute(runner)
    assert reschedule == [True]
    triton.clients["x"].cancelled = True
    triton.queued.clear()
    reschedule, stats = triton.execute(runner, [])
    assert reschedule == [] and stats.num_cancelled_between == 1
    assert runner.num_live == 0
    assert_pool_whole(engine)


def test_bad_input_costs_that_request_one_error_and_nothing_else(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("ok", max_tokens=5, temperature=0.0, ignore_eos=True)
    triton.submit("bad", temperature=-1.0)
    triton.submit("long", max_tokens=100_000)
    reschedule, _ = triton.execute(runner, ["bad", "long", "ok"])
    assert reschedule == [False, False, True]
    for name, field_name in (("bad", "temperature=-1.0"), ("long", "max_tokens")):
        _, _, error, _ = triton.final(name)
        assert error is not None and error.code == "INVALID_ARG" and field_name in error.message, error
        assert f"(request id '{name}')" in error.message
    triton.queued -= {"bad", "long"}
    triton.run(runner)
    assert triton.final("ok")[2] is None and triton.text("ok")
    assert_pool_whole(engine)


def test_null_requests_are_neither_answered_nor_rescheduled(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("a", max_tokens=3, temperature=0.0, ignore_eos=True)
    reschedule, stats = triton.execute(runner, [None, "a", None])
    assert reschedule == [False, True, False] and stats.num_null == 2
    triton.run(runner)
    assert triton.final("a")[2] is None
    assert_pool_whole(engine)


def test_a_request_that_ended_on_an_earlier_sender_is_let_go_when_it_comes_back(engine):
    """TensorRT-LLM's stop=true ends the target on its last sender; Triton still hands the target in once more
    (not a start): it must be released without a send and without a reschedule."""
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("target", max_tokens=50, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)
    triton.submit("stopper", parameters={"stop": True})
    triton.clients["stopper"].inputs = {}  # TensorRT-LLM sends the stop flag alone, under the target's request id
    triton.clients["stopper"].request_id = "target"
    reschedule, _ = triton.execute(runner, ["stopper"])  # the target waits in its slot meanwhile
    assert reschedule == [False]
    assert triton.final("target")[2].code == "CANCELLED"  # on the sender of its last execute
    assert triton.final("stopper")[2] is None  # the stop request's own empty final
    sent = len(triton.clients["target"].sent)
    reschedule, _ = triton.execute(runner, ["target"])  # back once more, not a start: let go silently
    assert reschedule == [False] and len(triton.clients["target"].sent) == sent
    assert_pool_whole(engine)


def test_a_step_longer_than_the_idle_timeout_ends_its_requests_with_an_error_instead_of_a_reschedule(engine):
    """Triton releases the slot of a sequence idle past max_sequence_idle_microseconds; rescheduling it then fails
    inside Triton and its client would wait forever. The runner ends it with an error that names the setting."""
    triton = FakeTriton()
    runner = make(engine, triton, idle_timeout_s=0.2)
    triton.submit("slow", max_tokens=20, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)
    engine.step_hook = lambda: time.sleep(0.3)
    try:
        reschedule, _ = triton.execute(runner)
    finally:
        engine.step_hook = None
    assert reschedule == [False]
    _, _, error, _ = triton.final("slow")
    assert error.code == "UNAVAILABLE" and "max_sequence_idle_microseconds=200000" in error.message, error
    assert runner.num_live == 0
    assert_pool_whole(engine)


def test_an_engine_error_ends_every_live_request_also_those_held_back(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    for name in ("a", "b"):
        triton.submit(name, max_tokens=20, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)

    def boom():
        raise RuntimeError("injected")
    engine.step_hook = boom
    try:
        reschedule, _ = triton.execute(runner, ["a", None])  # b held back: it gets its final on its last sender
    finally:
        engine.step_hook = None
    assert reschedule == [False, False]
    for name in ("a", "b"):
        _, _, error, _ = triton.final(name)
        assert error.code == "INTERNAL" and "injected" in error.message
    assert runner.num_live == 0
    assert_pool_whole(engine)


def test_unloading_cancels_every_live_request(engine):
    triton = FakeTriton()
    answers = iter([True, False, False, False])
    runner = make(engine, triton, is_serving=lambda: next(answers), serving_check_period_s=0.0)
    triton.submit("a", max_tokens=50, temperature=0.0, ignore_eos=True, stream=True)
    for _ in range(3):
        triton.execute(runner)
    assert not triton.queued
    _, _, error, _ = triton.final("a")
    assert error.code == "CANCELLED" and "unloaded" in error.message
    assert_pool_whole(engine)


def test_samples_of_one_request_run_as_members_together(engine):
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("n3", max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    triton.run(runner)
    outputs, _, error, _ = triton.final("n3")
    assert error is None and len(outputs["text_output"]) == 3
    assert_pool_whole(engine)


def test_the_idle_poller_frees_a_sequence_cancelled_when_no_execute_follows(engine):
    """The last live request cancelled: Triton answers it and has nothing more to execute, so only the poller can
    give its KV back (and only while no execute runs)."""
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("last", max_tokens=40, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)
    assert runner.poll_idle(0.0) == 0  # not cancelled: it stays
    triton.clients["last"].cancelled = True
    assert runner.poll_idle(3600.0) == 0  # an execute ran within the period: leave it to the next one
    assert runner.poll_idle(0.0) == 1 and runner.num_live == 0
    assert_pool_whole(engine)


def test_a_second_request_under_a_clients_own_sequence_id_gets_an_error_final(engine):
    """perf_analyzer sends its own correlation ids to any sequence-batched model: a second request under a live id
    (not a start), or one whose id nobody here runs, is refused with a final that names sequence_id."""
    triton = FakeTriton()
    runner = make(engine, triton)
    triton.submit("first", max_tokens=20, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner)
    triton.submit("second", max_tokens=5)
    triton.cids["second"] = triton.cids["first"]  # the same sequence id
    triton.started.add("second")  # sent without the start flag
    reschedule, _ = triton.execute(runner, ["second"])
    assert reschedule == [False]
    _, _, error, _ = triton.final("second")
    assert error.code == "INVALID_ARG" and "sequence_id=1" in error.message and "'first'" in error.message
    triton.submit("stray", max_tokens=5)
    triton.started.add("stray")  # an id no sequence here runs, not a start
    reschedule, _ = triton.execute(runner, ["stray"])
    assert reschedule == [False] and triton.final("stray")[2].code == "INVALID_ARG"
    triton.queued -= {"second", "stray"}
    triton.run(runner)
    assert triton.final("first")[2] is None
    assert_pool_whole(engine)


def test_members_draft_and_verify_like_the_in_flight_loop():
    """Speculation under Triton's membership: a member held back keeps no drafts, the others draft; the texts are
    those of decoding without drafts and the pool is whole (rolled-back draft slots included)."""
    prompts = {"count": ("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,", 24),
               "echo": ("a b c d a b c d a b c d a b", 16)}
    plain = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_num_seqs=8, speculative_method="off"))
    expected = reference_texts(plain, prompts)
    drafting = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_num_seqs=8, speculative_method="ngram",
                                      num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                                      speculative_draft_policy="always"))  # drafts whatever they cost
    drafting.step_hook = lambda: drafting.block_manager.check_invariants(list(drafting.seqs.values()))
    triton = FakeTriton()
    runner = make(drafting, triton)
    for name, (prompt, n) in prompts.items():
        triton.submit(name, prompt, max_tokens=n, temperature=0.0, ignore_eos=True, stream=True)
    triton.execute(runner, ["count", "echo"])
    echo = drafting.seqs[runner.sequences[triton.cids["echo"]].live.internal_id]
    for _ in range(3):  # echo held back: it neither moves nor holds drafts while count steps alone
        held = echo.num_output_tokens
        triton.execute(runner, ["count", None])
        assert echo.num_output_tokens == held and not echo.spec_token_ids
    triton.run(runner)
    for name in prompts:
        assert triton.final(name)[2] is None
        assert triton.text(name) == expected[name] and expected[name]
    counters = drafting.metrics.snapshot()["counters"]
    assert counters["spec_decode_num_draft_tokens"] > 0, counters
    assert_pool_whole(drafting)


def assert_the_poller_frees_a_cancelled_idle_sequence(engine, triton, runner, params: dict, handed=None) -> None:
    """The idle poller still runs: a last request, cancelled with no execute after it, is freed."""
    triton.submit("idle", **params)
    triton.execute(runner, handed)
    triton.clients["idle"].cancelled = True
    triton.queued.discard("idle")
    assert wait_until(lambda: runner.num_live == 0), "the idle poller did not free the cancelled sequence"
    assert_pool_whole(engine)


def test_a_stop_requests_failed_final_costs_that_request_only(engine):
    """TensorRT-LLM's stop=true whose own final send raises: its targets still end CANCELLED, every other sequence
    (of another client, or handed in after it in the same execute) runs on to one final, the idle poller keeps
    freeing cancelled sequences, and no KV block is lost."""
    triton = FlakyTriton(fail_final_of="stopper")
    runner = make(engine, triton)
    runner.start_idle_poller(0.02)
    try:
        common = dict(max_tokens=12, temperature=0.0, ignore_eos=True, stream=True)
        for name, request_id in (("victim1", "victim"), ("victim2", "victim"), ("by1", "bystander"),
                                 ("by2", "bystander")):
            triton.submit(name, **common)
            triton.clients[name].request_id = request_id
        triton.execute(runner)
        triton.submit("stopper", parameters={"stop": True})
        triton.clients["stopper"].inputs = {}
        triton.clients["stopper"].request_id = "victim"
        triton.submit("late", **common)  # a start handed in after the stop request, in the same execute
        triton.execute(runner, ["by1", "stopper", "victim1", "late", "by2", "victim2"])
        triton.run(runner)
        for name in ("victim1", "victim2"):
            assert triton.final(name)[2].code == "CANCELLED"
        for name in ("by1", "by2", "late"):
            assert triton.final(name)[2] is None and triton.text(name)
        assert triton.final("stopper")[2].code == "INTERNAL"  # its one final, after the failed one
        assert_pool_whole(engine)

        assert_the_poller_frees_a_cancelled_idle_sequence(engine, triton, runner, common)
    finally:
        runner.close()


def test_ending_every_sequence_after_an_execute_error_keeps_the_idle_poller(engine):
    """The model's execute failed (model.py then ends every live sequence and releases the handed requests): the
    model still serves, so the poller must keep freeing cancelled sequences, and a sequence that was held back
    comes back once from Triton's slot and is let go without a second final."""
    triton = FakeTriton()
    runner = make(engine, triton, request_hook=FailingHook())
    runner.start_idle_poller(0.02)
    try:
        common = dict(max_tokens=30, temperature=0.0, ignore_eos=True, stream=True)
        for name in ("a", "held"):
            triton.submit(name, **common)
        triton.execute(runner)
        triton.submit("boom", parameters={FailingHook.parameter: True})
        with pytest.raises(RuntimeError, match="injected"):  # `held` waits in its slot meanwhile
            runner.execute(triton.handed(["a", "boom", None]))
        runner.end_all("ended: internal error in execute")  # what model.py does then
        triton.queued -= {"a", "boom"}  # released without a reschedule
        for name in ("a", "held"):
            assert triton.final(name)[2] is not None and "internal error in execute" in triton.final(name)[2].message
        sent = len(triton.clients["held"].sent)
        reschedule, _ = triton.execute(runner, ["held"])
        assert reschedule == [False] and len(triton.clients["held"].sent) == sent
        assert_pool_whole(engine)

        assert_the_poller_frees_a_cancelled_idle_sequence(engine, triton, runner, common, ["idle"])
    finally:
        runner.close()
