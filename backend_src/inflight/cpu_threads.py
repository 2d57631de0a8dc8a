"""Which thread runs the CPU forward's OpenMP teams, and how wide: full width while the cores are ours, fewer
threads while other processes keep them busy.

One thread only. libgomp keeps a pool of worker threads per thread that starts a team, and once it manages
more threads than there are CPUs it cuts every wait's spin to a few rounds. A served engine loads its model in
Triton's stub thread and steps in its own loop thread: two pools, so its threads slept between regions
whatever GOMP_SPINCOUNT said (SmolLM2, one row: 52 ms a step from the loop thread against 39 from the thread
that loaded it). So the model loads at one thread (no team, no pool) and the first step sets the chosen width
on the thread that steps.

Width. Each decode step runs ~150 parallel regions (one per linear). Threads that sleep between regions pay a
wake-up at each: a third of an idle machine's step, and the second core bought 1.06x. Threads that spin a
little (GOMP_SPINCOUNT, set in inflight/__init__.py) scale 1.44x, but collapse when another process wants one
of their cores: every region then waits for a descheduled thread (1.5x slower than one thread, one core
hogged). A team of one has no barrier to wait at. So, when adaptive, this samples once a second how much of
the engine's cores other processes used (/proc/stat, minus this process's own time) and sets the width to the
cores left over: down at once, back up only after a few quiet samples. After the engine sat idle it measures anew
(what others did while it idled is no contention) and a quiet first window restores the full width at once.
The width does not change results: the linears give bitwise-equal outputs at 1 and 2 threads. The engine option
cpu_thread_governor=false keeps the width fixed.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)


# What load_at_one_thread() found and what it left: a second engine in the process, built before the first has
# stepped on this thread, would otherwise read the 1 the first one left for loading as its width.
_width_found: int | None = None
_left_at_one = False


def load_at_one_thread(get_threads: Callable[[], int], set_threads: Callable[[int], None]) -> int:
    """Drop the calling thread to one OpenMP thread for loading; returns the width to step at: the thread's
    count as found, or, when that is the 1 an earlier engine left for its own loading, the width that engine
    found. (Without this, `LLM(...)` built twice before any step, as perf/bench/offline.py does, gave the second
    engine a single thread.) To run a later engine at one thread on purpose, build it with OMP_NUM_THREADS=1 in
    the environment or after torch.set_num_threads(1) before the first engine."""
    global _width_found, _left_at_one
    current = get_threads()
    width = _width_found if current == 1 and _left_at_one and _width_found else current
    _width_found, _left_at_one = width, True
    set_threads(1)
    return width


def width_set_explicitly() -> None:
    """The caller has just set this thread's count on purpose (an instance's share of the cores): the next
    engine takes it as found, even if it is 1."""
    global _left_at_one
    _left_at_one = False


def _cpu_ticks(cpus: Iterable[int], proc_stat: str = "/proc/stat") -> int:
    """Busy clock ticks (everything but idle and iowait; steal counts: the hypervisor took the core) of the given
    CPUs since boot."""
    wanted = {f"cpu{i}" for i in cpus}
    busy = 0
    with open(proc_stat) as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in wanted:
                values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
                busy += sum(values) - values[3] - values[4]
    return busy


def _own_ticks(stat_path: str = "/proc/self/stat") -> int:
    """This process's user + system clock ticks, all threads."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)


def read_usage() -> tuple[int, int]:
    """(busy ticks of the CPUs this process may run on, this process's ticks)."""
    return _cpu_ticks(os.sched_getaffinity(0)), _own_ticks()


class ThreadGovernor:
    """Call before_step() on the thread that runs the forward: OpenMP's thread count belongs to the calling
    thread, so the width is (re)applied whenever the stepping thread changes."""

    def __init__(self, full_threads: int, num_cores: int, set_threads: Callable[[int], None], adaptive: bool = True,
                 usage: Callable[[], tuple[int, int]] = read_usage, clock: Callable[[], float] = time.monotonic,
                 ticks_per_s: float = float(os.sysconf("SC_CLK_TCK")), period_s: float = 1.0, quiet_samples: int = 3,
                 idle_s: float = 0.25, resume_sample_s: float = 0.25):
        self.full = full_threads
        self.num_cores = num_cores
        self.threads = full_threads
        self.adaptive = adaptive
        self._stepping_thread: int | None = None
        self._set_threads = set_threads
        self._usage = usage
        self._clock = clock
        self._ticks_per_s = ticks_per_s
        self.period_s = period_s
        self.quiet_samples = quiet_samples
        self._quiet = 0
        self._last: tuple[float, int, int] | None = None
        self.changes = 0
        # A gap of more than idle_s between one step's end and the next step's start is idleness: the first
        # window after it is resume_sample_s long, and a quiet one restores the full width at once.
        self.idle_s = idle_s
        self.resume_sample_s = resume_sample_s
        self._step_ended: float | None = None
        self._resumed = False

    def others_cores(self) -> float | None:
        """Cores' worth of time other processes took on our CPUs since the last sample (None at the first)."""
        now = self._clock()
        busy, own = self._usage()
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return None
        return max(0.0, (busy - last[1]) - (own - last[2])) / self._ticks_per_s / (now - last[0])

    def before_step(self) -> None:
        if threading.get_ident() != self._stepping_thread:
            self._stepping_thread = threading.get_ident()
            self._set_threads(self.threads)
        if not self.adaptive or self.full <= 1:
            return
        now = self._clock()
        if self._step_ended is not None and now - self._step_ended > self.idle_s:
            # The engine sat idle: what other processes did meanwhile says nothing of what they do while it runs.
            # (Counted in, a peer server's burst between two of our requests held us at one thread for seconds.)
            # Measure anew, over a short first window.
            self._last, self._resumed = None, True
        self._step_ended = None
        if self._last is not None and now - self._last[0] < (self.resume_sample_s if self._resumed else self.period_s):
            return
        others = self.others_cores()
        if others is None:
            return
        resumed, self._resumed = self._resumed, False
        free = self.num_cores - others
        if free < self.threads - 0.5:  # someone took a core from the team: shrink now
            self._quiet = 0
            self._apply(max(1, int(free + 0.5)), others)
        elif self.threads < self.full and free >= self.threads + 0.75:  # a core came back: grow once it stays
            self._quiet += 1
            if resumed or self._quiet >= self.quiet_samples:  # a narrow width from before an idle gap is stale
                self._quiet = 0
                self._apply(min(self.full, int(free + 0.25)), others)
        else:
            self._quiet = 0

    def after_step(self) -> None:
        """Call when the forward returns: the time to the next before_step() tells idleness from work."""
        self._step_ended = self._clock()

    def _apply(self, threads: int, others: float) -> None:
        if threads == self.threads:
            return
        log.info("CPU threads %d -> %d: other processes used %.2f of %d cores", self.threads, threads, others,
                 self.num_cores)
        self.threads = threads
        self.changes += 1
        self._set_threads(threads)
