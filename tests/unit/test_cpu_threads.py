"""inflight.cpu_threads: the CPU forward's thread count follows the cores other processes leave free."""
from __future__ import annotations

import os
import threading

import pytest

from inflight.config import EngineConfig
from inflight.cpu_threads import ThreadGovernor, _cpu_ticks, _own_ticks, read_usage

GOVERNOR_ENV = "INFLIGHT_CPU_GOVERNOR"

TICKS = 100.0  # per second


class FakeHost:
    """A 2-core host: each tick() advances 1 s, with `ours` and `others` cores' worth of busy time."""

    def __init__(self):
        self.now, self.busy, self.own = 0.0, 0, 0
        self.reads = 0
        self.set_calls: list[int] = []

    def tick(self, ours: float, others: float, seconds: float = 1.0) -> None:
        self.now += seconds
        self.own += int(ours * TICKS * seconds)
        self.busy += int((ours + others) * TICKS * seconds)

    def usage(self):
        self.reads += 1
        return self.busy, self.own

    def governor(self, full: int = 2) -> ThreadGovernor:
        return ThreadGovernor(full, 2, self.set_calls.append, usage=self.usage, clock=lambda: self.now,
                              ticks_per_s=TICKS, period_s=1.0, quiet_samples=3)


def test_a_quiet_host_keeps_every_thread():
    host = FakeHost()
    gov = host.governor()
    for _ in range(10):
        gov.before_step()
        host.tick(ours=2.0, others=0.1)
    assert gov.threads == 2 and host.set_calls == [2]  # applied once, on the stepping thread


def test_another_process_on_a_core_drops_to_one_thread_at_once_and_quiet_brings_it_back_slowly():
    host = FakeHost()
    gov = host.governor()
    gov.before_step()  # first sample: nothing to compare yet
    host.tick(ours=1.0, others=1.0)  # a busy loop elsewhere took a core
    gov.before_step()
    assert gov.threads == 1 and host.set_calls == [2, 1]
    for _ in range(2):  # quiet, but not for long enough
        host.tick(ours=1.0, others=0.1)
        gov.before_step()
    assert gov.threads == 1
    host.tick(ours=1.0, others=0.6)  # busy again: the quiet count starts over
    gov.before_step()
    for _ in range(2):
        host.tick(ours=1.0, others=0.1)
        gov.before_step()
    assert gov.threads == 1
    host.tick(ours=1.0, others=0.1)  # the third quiet sample in a row
    gov.before_step()
    assert gov.threads == 2 and host.set_calls == [2, 1, 2] and gov.changes == 2


def test_a_little_background_work_is_not_contention():
    host = FakeHost()
    gov = host.governor()
    gov.before_step()
    host.tick(ours=1.8, others=0.4)  # tritonserver's threads, a load client: 0.4 of a core
    gov.before_step()
    assert gov.threads == 2


def test_it_samples_at_most_once_a_period_and_not_at_all_with_one_thread():
    host = FakeHost()
    gov = host.governor()
    gov.before_step()
    for _ in range(50):  # many steps within one second
        host.tick(ours=2.0, others=1.5, seconds=0.01)
        gov.before_step()
    assert host.reads == 1 and gov.threads == 2
    host.tick(ours=2.0, others=1.5, seconds=0.5)
    gov.before_step()
    assert host.reads == 2 and gov.threads == 1
    single = FakeHost()
    one = single.governor(full=1)
    for _ in range(5):
        single.tick(ours=1.0, others=1.0)
        one.before_step()
    assert single.reads == 0 and single.set_calls == [1]


def _idle(host: FakeHost, gov: ThreadGovernor, others: float, seconds: float) -> None:
    """The engine finishes a step, then sits idle while other processes use `others` cores."""
    gov.after_step()
    host.tick(ours=0.0, others=others, seconds=seconds)


def test_what_others_did_while_the_engine_sat_idle_is_not_contention():
    host = FakeHost()
    gov = host.governor()
    gov.before_step()
    host.tick(ours=2.0, others=0.1)
    gov.before_step()
    _idle(host, gov, others=2.0, seconds=30)  # a peer server's load test between two of our requests
    gov.before_step()  # a new baseline, not a sample over the idle 30 s
    for _ in range(5):
        gov.after_step()
        host.tick(ours=2.0, others=0.1, seconds=0.3)
        gov.before_step()
    assert gov.threads == 2 and host.set_calls == [2]


def test_after_an_idle_gap_a_quiet_first_window_restores_every_thread_and_a_busy_one_keeps_one():
    for others, want in ((0.1, [2, 1, 2]), (1.0, [2, 1])):
        host = FakeHost()
        gov = host.governor()
        gov.before_step()
        host.tick(ours=1.0, others=1.0)  # contention while running: one thread
        gov.before_step()
        _idle(host, gov, others=1.5, seconds=10)
        gov.before_step()
        gov.after_step()
        host.tick(ours=1.0, others=others, seconds=0.1)  # shorter than the first window after idling: no sample
        gov.before_step()
        assert gov.threads == 1
        gov.after_step()
        host.tick(ours=1.0, others=others, seconds=0.2)
        gov.before_step()  # 0.3 s after resuming: one quiet window is enough now, where a busy one changes nothing
        assert host.set_calls == want, others


def test_the_width_is_applied_on_whichever_thread_steps_and_fixed_when_not_adaptive():
    host = FakeHost()
    gov = ThreadGovernor(2, 2, host.set_calls.append, adaptive=False, usage=host.usage, clock=lambda: host.now,
                         ticks_per_s=TICKS)
    gov.before_step()
    gov.before_step()
    worker = threading.Thread(target=gov.before_step)  # the engine moved to another thread: apply it there too
    worker.start()
    worker.join()
    host.tick(ours=1.0, others=1.5)
    gov.before_step()  # back on this thread: applied again; contention is not looked at
    assert host.set_calls == [2, 2, 2] and host.reads == 0 and gov.threads == 2


def test_proc_files_are_parsed(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 5 0 0 0 0 0\n"
                    "cpu0 10 1 5 400 2 1 1 3 0 0\n"
                    "cpu1 90 0 45 600 3 0 0 0 0 0\n"
                    "intr 12345\n")
    assert _cpu_ticks([0], str(stat)) == 10 + 1 + 5 + 1 + 1 + 3  # idle and iowait left out, steal counted
    assert _cpu_ticks([0, 1], str(stat)) == 21 + 135
    own = tmp_path / "self_stat"
    # The command name may hold spaces and parentheses: fields are counted after its last ')'.
    own.write_text("42 (a (b) c) S 1 42 42 0 -1 4194304 100 0 0 0 70 30 0 0 20 0 5 0 100 0 0\n")
    assert _own_ticks(str(own)) == 100
    busy, mine = read_usage()  # the real files: this process has run, and its time is part of its CPUs' busy time
    assert busy >= mine > 0


def test_the_switch(monkeypatch):
    monkeypatch.delenv(GOVERNOR_ENV, raising=False)
    assert EngineConfig.from_options().cpu_thread_governor is True
    assert EngineConfig.from_options(cpu_thread_governor="false").cpu_thread_governor is False
    monkeypatch.setenv(GOVERNOR_ENV, "0")
    assert EngineConfig.from_options(cpu_thread_governor=True).cpu_thread_governor is False
    monkeypatch.setenv(GOVERNOR_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{GOVERNOR_ENV}='maybe' is out of range: allowed true or false"):
        EngineConfig.from_options()


def test_a_cpu_runner_loads_at_one_thread_and_its_first_step_sets_the_width(monkeypatch):
    """Loading must not start an OpenMP team: the thread that steps is to be the only one that does."""
    import torch

    from engine_helpers import TINY
    from inflight import LLM, SamplingParams
    before = torch.get_num_threads()
    monkeypatch.delenv(GOVERNOR_ENV, raising=False)
    try:
        llm = LLM(TINY, num_kv_blocks=16)
        gov = llm.engine.runner.governor
        assert gov is not None and gov.adaptive and gov.full == before and gov.num_cores == len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == 1  # after loading, before any step
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        assert torch.get_num_threads() == gov.threads
        assert not LLM(TINY, num_kv_blocks=16, cpu_thread_governor=False).engine.runner.governor.adaptive
    finally:
        torch.set_num_threads(before)


def test_a_second_engine_built_before_any_step_gets_the_width_the_first_found():
    """The first engine leaves the thread at one for loading; the second must not take that 1 as its width."""
    import torch

    from engine_helpers import TINY
    from inflight import LLM
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = LLM(TINY, num_kv_blocks=16)
        assert torch.get_num_threads() == 1  # left for loading
        second = LLM(TINY, num_kv_blocks=16)
        assert first.engine.runner.governor.full == second.engine.runner.governor.full == 2
    finally:
        torch.set_num_threads(before)


def test_load_at_one_thread_takes_the_current_width_unless_it_is_the_one_left_for_loading():
    from inflight import cpu_threads
    count = [3]
    get, put = (lambda: count[0]), (lambda n: count.__setitem__(0, n))
    cpu_threads._width_found, cpu_threads._left_at_one = None, False
    assert cpu_threads.load_at_one_thread(get, put) == 3 and count[0] == 1
    assert cpu_threads.load_at_one_thread(get, put) == 3  # the 1 it left is not a width
    count[0] = 2  # an operator (or a governor on this thread) set a width since
    assert cpu_threads.load_at_one_thread(get, put) == 2 and count[0] == 1
    cpu_threads.width_set_explicitly()  # an instance's share set on purpose, even 1, is taken as found
    count[0] = 1
    assert cpu_threads.load_at_one_thread(get, put) == 1
