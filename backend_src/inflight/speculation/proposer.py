"""The one interface every draft source implements: given a running sequence, the tokens it is likely to produce
next. The engine verifies them in the next forward (scheduler, runner, verify.py), so a proposer only guesses: a
wrong guess costs compute, never correctness.

A draft model or an EAGLE-style head plugs in as another class with these two methods, chosen by
speculative_method in speculator.make_proposer (docs/speculative.md says what else it needs). The scheduler,
the runner and the KV rollback see only token ids.
"""
from __future__ import annotations

from typing import Protocol

from ..sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most max_tokens (>= 1) draft tokens to follow seq.token_ids; [] when there is no good guess.
        seq.token_ids only grows between calls (drafts are never appended to it, accepted tokens are)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """The sequence finished: drop whatever was kept for it."""
        ...
