"""When to speculate, and for whom: the engine's one entry point to drafting.

Before each step the engine asks propose() to set the drafts (Sequence.spec_token_ids) of the running requests that
decode; the scheduler then gives them budget and KV blocks or drops them (scheduler.py), the runner verifies them in
the step's forward (model_runner.prepare), and after sampling the accepted ones are kept and the rest rolled back
(engine._on_draft_tokens, Scheduler.commit_drafts).

Drafting pays while a forward is bound by reading the weights, so that more rows cost little more than one (a CPU
step of one request, a small GPU batch); once the batch is large the forward is bound by its rows, and a rejected
draft is a row wasted. Past speculative_disable_by_batch_size running requests no drafts are proposed at all
(docs/speculative.md has the measurement behind the default). Below it, under the default policy ("cost"), a
request drafts only as many tokens as its guesses are expected to be worth the rows they add, by the step costs
this engine measures (policy.py): on text that prompt lookup cannot guess, drafting then costs next to nothing.
"""
from __future__ import annotations

import logging
import weakref

from ..config import EngineConfig
from ..sequence import Sequence
from .ngram import NgramProposer
from .policy import Acceptance, StepCosts, expected_accepted, worth_drafting
from .proposer import Proposer

log = logging.getLogger(__name__)


def resolve_method(config: EngineConfig) -> str:
    """speculative_method as it applies on this device: auto is ngram on CPU, off on CUDA (not yet measured
    there: a speculative step cannot replay a CUDA graph, and a graph replay is what a small GPU batch needs)."""
    if config.speculative_method != "auto":
        return config.speculative_method
    return "off" if str(config.device).startswith("cuda") else "ngram"


def make_proposer(method: str, config: EngineConfig) -> Proposer:
    if method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_method={method!r} has no proposer: allowed ngram")


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, disable_by_batch_size: int,
                 policy: str = "cost"):
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.weigh_costs = policy == "cost"  # "always": every guess is drafted, at the length below
        self.costs = StepCosts()
        # Per request, how many drafts to propose next at most: drafts past the first rejected one are rows
        # computed for nothing, so the length follows what the request's drafts achieve (observe()).
        self._lengths: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._acceptance: weakref.WeakKeyDictionary[Sequence, Acceptance] = weakref.WeakKeyDictionary()
        # A guess not drafted: (position, token), checked against the token sampled there (_check_guess).
        self._guesses: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Speculator | None":
        """None when speculation is off for this engine."""
        method = resolve_method(config)
        if method == "off":
            log.info("speculative decoding: off (speculative_method=%s)", config.speculative_method)
            return None
        log.info("speculative decoding: %s, up to %d draft tokens, n-grams of %d-%d tokens, while at most %d "
                 "requests run, draft policy %s", method, config.num_speculative_tokens, config.prompt_lookup_min,
                 config.prompt_lookup_max, config.speculative_disable_by_batch_size,
                 config.speculative_draft_policy)
        return cls(make_proposer(method, config), config.num_speculative_tokens,
                   config.speculative_disable_by_batch_size, config.speculative_draft_policy)

    def propose(self, running: list[Sequence]) -> bool:
        """Set spec_token_ids on the running requests that decode and allow it (every other request keeps none);
        True when some request got drafts."""
        if len(running) > self.disable_by_batch_size:
            return False
        k = self.num_speculative_tokens
        drafted = False
        rows = expected_tokens = len(running)  # the step without drafts: a row and a token per request
        for seq in running:
            # Drafts follow a sampled token: not during prefill, nor before the first token (whose row also
            # starts the request's other samples). Not under a grammar: its matcher would have to follow the
            # drafts and roll back with them.
            if seq.num_uncomputed_tokens != 1 or not seq.num_output_tokens or not seq.params.speculative_decoding \
                    or seq.grammar is not None:
                continue
            acceptance = self._check_guess(seq)
            # Never past max_tokens: the step appends the accepted drafts and one token more.
            room = min(self._lengths.get(seq, k), seq.max_tokens - seq.num_output_tokens - 1)
            guess = self.proposer.propose(seq, room) if room > 0 else []
            if not guess:
                continue
            num_drafts = len(guess)
            if self.weigh_costs:
                num_drafts = worth_drafting(self.costs, rows, expected_tokens, acceptance.rate, num_drafts)
                rows += num_drafts
                expected_tokens += expected_accepted(acceptance.rate, num_drafts)
            if num_drafts:
                seq.spec_token_ids = guess[:num_drafts]
                drafted = True
            else:
                self._guesses[seq] = (len(seq.token_ids), guess[0])
        return drafted

    def _acceptance_of(self, seq: Sequence) -> Acceptance:
        acceptance = self._acceptance.get(seq)
        if acceptance is None:
            acceptance = self._acceptance[seq] = Acceptance()
        return acceptance

    def _check_guess(self, seq: Sequence) -> Acceptance:
        """The request's acceptance, with its last guess held back (if any) now counted: did the step sample it?"""
        acceptance = self._acceptance_of(seq)
        guess = self._guesses.pop(seq, None)
        if guess is not None and len(seq.token_ids) > guess[0]:
            acceptance.add(int(seq.token_ids[guess[0]] == guess[1]), 1)
        return acceptance

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verification: the next draft may be two tokens longer when all of these held, one shorter
        (at least one) when one failed (the schedule of Hugging Face's assisted generation). Each draft up to
        the first rejected one was a guess tried."""
        k = self.num_speculative_tokens
        length = self._lengths.get(seq, k)
        self._lengths[seq] = min(k, length + 2) if num_accepted == num_drafts else max(1, length - 1)
        self._acceptance_of(seq).add(num_accepted, num_accepted + (num_accepted < num_drafts))

    def decode_rows(self, scheduled: list[tuple[Sequence, int]]) -> int:
        """Rows of a step that only decodes (each request its newest token and its drafts); 0 when the step
        computes any prompt chunk, whose cost is not a decode step's."""
        if any(n != 1 + len(seq.spec_token_ids) or seq.num_uncomputed_tokens != 1 for seq, n in scheduled):
            return 0
        return sum(n for _, n in scheduled)

    def record_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows took `seconds` (the engine, after each such step)."""
        self.costs.record(rows, seconds)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)
        self._lengths.pop(seq, None)
        self._acceptance.pop(seq, None)
        self._guesses.pop(seq, None)
