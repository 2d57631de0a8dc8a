"""Whether a draft is worth its verification rows: what the engine's own decode steps cost per row count, measured
as it runs, against how many tokens a request's drafts are expected to yield, estimated from its guesses.

A draft of k tokens makes the step compute k more rows; it pays when the tokens it is expected to add, per second
of the dearer step, beat the plain step's. Both sides are measured, never assumed: the step cost per row count is
a running average of the engine's decode-only steps (so it follows the machine: another process on the cores, a
thread governor that took a thread away), and a request's acceptance rate counts every guess the proposer made,
drafted or not (a guess held back is checked against the token the step then sampled), so a request whose guesses
stop holding stops paying for them, and one whose guesses start holding again is seen to without drafting.
"""
from __future__ import annotations

from dataclasses import dataclass

COST_WEIGHT = 0.2  # weight of the newest step in a row count's running average of step seconds
STALE_AFTER_STEPS = 2000  # a row count not measured in this many decode steps is measured again
ACCEPTANCE_DECAY = 0.9  # per observation: about the last ten guesses make up a request's acceptance rate


class StepCosts:
    """Seconds of a decode-only engine step by its number of rows (decodes plus draft tokens)."""

    stale_after_steps = STALE_AFTER_STEPS

    def __init__(self) -> None:
        self._seconds: dict[int, tuple[float, int]] = {}  # rows -> (running average, num_recorded when last set)
        self.num_recorded = 0

    def record(self, rows: int, seconds: float) -> None:
        self.num_recorded += 1
        old = self._fresh(rows)
        average = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self._seconds[rows] = (average, self.num_recorded)

    def estimate(self, rows: int) -> float | None:
        """A step of `rows` rows: as measured lately, else as the nearest smaller count measured lately (an
        unmeasured count looks as cheap as that, so a draft that would pay there is tried, which measures it).
        None when nothing was measured lately."""
        for r in range(rows, 0, -1):
            seconds = self._fresh(r)
            if seconds is not None:
                return seconds
        return None

    def _fresh(self, rows: int) -> float | None:
        entry = self._seconds.get(rows)
        if entry is None or self.num_recorded - entry[1] > self.stale_after_steps:
            return None
        return entry[0]


@dataclass
class Acceptance:
    """A request's rate of guesses that held, recent ones weighing more; it starts at one hit in two tries, so a
    new request drafts where rows are cheap enough for even odds."""
    hits: float = 1.0
    tries: float = 2.0

    def add(self, hits: int, tries: int) -> None:
        self.hits = ACCEPTANCE_DECAY * self.hits + hits
        self.tries = ACCEPTANCE_DECAY * self.tries + tries

    @property
    def rate(self) -> float:
        return self.hits / self.tries


def expected_accepted(rate: float, num_drafts: int) -> float:
    """Drafts expected to hold of num_drafts, each held with `rate` once the ones before it held."""
    return sum(rate ** i for i in range(1, num_drafts + 1))


def worth_drafting(costs: StepCosts, rows: int, tokens: float, rate: float, max_drafts: int) -> int:
    """How many drafts (0 to max_drafts) to add to a step that already computes `rows` rows for `tokens` expected
    tokens: the count with the most expected tokens per second of the step. max_drafts when nothing is measured."""
    base = costs.estimate(rows)
    if base is None:
        return max_drafts
    best, best_rate = 0, tokens / base
    for k in range(1, max_drafts + 1):
        tokens_per_s = (tokens + expected_accepted(rate, k)) / costs.estimate(rows + k)
        if tokens_per_s > best_rate:
            best, best_rate = k, tokens_per_s
    return best
