"""Wall time per phase of engine steps, for benchmarks. The engine always reports its phases to a timer; the
default NULL_TIMER ignores them, at the cost of one empty call per phase."""
from __future__ import annotations

import time

import torch

# overlap: host work between launching the forward and the sampler (the scheduler's bookkeeping, deferred
# detokenizing), which on CUDA runs while the device computes.
PHASES = ("schedule", "prepare", "forward", "overlap", "mask", "sample", "detokenize", "other")


class NullTimer:
    """What the engine reports to when nothing measures it."""

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def end_step(self) -> None:
        pass


NULL_TIMER = NullTimer()


class StepTimer:
    """engine.set_step_timer(StepTimer()) turns it on. Phases are laps between marks in engine.step and
    ModelRunner.execute. sync=True waits for the device at each mark, so GPU work is charged to the phase
    that queued it rather than to the next one that waits (the engine syncs once per step anyway, when it
    reads the sampled tokens, so this costs little). keep_steps records each step's laps too."""

    def __init__(self, sync: bool = False, keep_steps: bool = False):
        self.sync = sync and torch.cuda.is_available()
        self.keep_steps = keep_steps
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}
        self._t = 0.0

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self._current = {}
        self._t = self._now()

    def lap(self, phase: str) -> None:
        now = self._now()
        self._current[phase] = self._current.get(phase, 0.0) + now - self._t
        self._t = now

    def end_step(self) -> None:
        self.lap("other")
        for phase, seconds in self._current.items():
            self.totals[phase] += seconds
        self.num_steps += 1
        if self.keep_steps:
            self.steps.append(self._current)
        self._current = {}
