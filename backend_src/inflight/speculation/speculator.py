"""When to speculate, and for whom: the engine's one entry point to drafting.

Before each step the engine asks propose() to set the drafts (Sequence.spec_token_ids) of the running requests that
decode; the scheduler then gives them budget and KV blocks or drops them (scheduler.py), the runner verifies them in
the step's forward (model_runner.prepare), and after sampling the accepted ones are kept and the rest rolled back
(engine._on_draft_tokens, Scheduler.commit_drafts).

Drafting pays while a forward is bound by reading the weights, so that more rows cost little more than one (a CPU
step of one request, a small GPU batch); once the batch is large the forward is bound by its rows, and a rejected
draft is a row wasted. Past speculative_disable_by_batch_size running requests no drafts are proposed at all
(docs/speculative.md has the measurement behind the default).
"""
from __future__ import annotations

import logging
import weakref

from ..config import EngineConfig
from ..sequence import Sequence
from .ngram import NgramProposer
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
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, disable_by_batch_size: int):
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        # Per request, how many drafts to propose next: drafts past the first rejected one are rows computed for
        # nothing, so the length follows what the request's drafts achieve (observe()).
        self._lengths: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Speculator | None":
        """None when speculation is off for this engine."""
        method = resolve_method(config)
        if method == "off":
            log.info("speculative decoding: off (speculative_method=%s)", config.speculative_method)
            return None
        log.info("speculative decoding: %s, up to %d draft tokens, n-grams of %d-%d tokens, while at most %d "
                 "requests run", method, config.num_speculative_tokens, config.prompt_lookup_min,
                 config.prompt_lookup_max, config.speculative_disable_by_batch_size)
        return cls(make_proposer(method, config), config.num_speculative_tokens,
                   config.speculative_disable_by_batch_size)

    def propose(self, running: list[Sequence]) -> bool:
        """Set spec_token_ids on the running requests that decode and allow it (every other request keeps none);
        True when some request got drafts."""
        if len(running) > self.disable_by_batch_size:
            return False
        k = self.num_speculative_tokens
        drafted = False
        for seq in running:
            # Drafts follow a sampled token: not during prefill, nor before the first token (whose row also
            # starts the request's other samples). Not under a grammar: its matcher would have to follow the
            # drafts and roll back with them.
            if seq.num_uncomputed_tokens != 1 or not seq.num_output_tokens or not seq.params.speculative_decoding \
                    or seq.grammar is not None:
                continue
            # Never past max_tokens: the step appends the accepted drafts and one token more.
            room = min(self._lengths.get(seq, k), seq.max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                seq.spec_token_ids = self.proposer.propose(seq, room)
                drafted = drafted or bool(seq.spec_token_ids)
        return drafted

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verification: the next draft may be two tokens longer when all of these held, one shorter
        (at least one) when one failed (the schedule of Hugging Face's assisted generation)."""
        k = self.num_speculative_tokens
        length = self._lengths.get(seq, k)
        self._lengths[seq] = min(k, length + 2) if num_accepted == num_drafts else max(1, length - 1)

    def forget(self, seq: Sequence) -> None:
        self.proposer.forget(seq)
        self._lengths.pop(seq, None)
