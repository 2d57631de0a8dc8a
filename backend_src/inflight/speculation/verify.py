"""Verification of draft tokens: what the sampler sees at each drafted position, and how many drafts hold.

A sequence with k drafts d1..dk gets k + 1 logits rows from one forward: row i is the model's next-token
distribution after the sequence's tokens and d1..di. Every row is sampled as a plain decode step at that position
would sample it (penalties, bans, min_tokens, temperature, top-k/p, the seeded uniform of that output index), row i
with the sequence seen through a DraftPosition. Draft d(i+1) is accepted when row i drew it; the first row that
drew anything else gives the step's last token, and if all k drafts hold, row k gives one more.

For a greedy request that is "accept while the argmax matches". For a sampled one it is rejection sampling with a
point-mass draft: row i's token t ~ p, so d(i+1) is accepted with probability p(d(i+1)), and when it is not, t is
distributed as p without d(i+1), renormalized: the residual distribution max(p - q, 0) of the textbook rule for
q = the draft's point mass. Every emitted token is therefore drawn from the target distribution, and a seeded
request draws the same tokens as it would without speculation (same uniform per output index).
"""
from __future__ import annotations

from functools import cached_property

from ..sequence import Sequence


class DraftPosition:
    """A sequence as it would be had its first `num_accepted` drafts been accepted: what the sampler reads of a
    Sequence (params, token counts, the tokens for penalties and bad words), for logits row num_accepted of its
    verification. A fresh object each step, so the sampler's per-sequence penalty counts start anew for it."""

    forked = True  # drafts exist only for sequences that decode, whose samples were all started
    grammar_matcher = None  # requests with a grammar never draft (Speculator.propose)
    grammar_must_end = False

    def __init__(self, seq: Sequence, drafts: list[int], num_accepted: int):
        self.seq = seq
        self.request_id = seq.request_id
        self.params = seq.params
        self.bad_word_ids = seq.bad_word_ids
        self.prompt_token_ids = seq.prompt_token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_output_tokens = seq.num_output_tokens + num_accepted
        self._drafts = drafts[:num_accepted]

    @cached_property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self._drafts

    def __len__(self) -> int:
        return len(self.seq.token_ids) + len(self._drafts)


def verification_rows(seq: Sequence, drafts: list[int]) -> list[Sequence | DraftPosition]:
    """The sampler's view of each of the seq's len(drafts) + 1 logits rows: row 0 is the sequence itself (its
    committed state), row i > 0 a DraftPosition."""
    return [seq] + [DraftPosition(seq, drafts, i) for i in range(1, len(drafts) + 1)]


def num_accepted(drafts: list[int], drawn: list[int]) -> int:
    """How many leading drafts the verification rows drew (drawn[i] is row i's token; len(drafts) + 1 rows)."""
    n = 0
    for draft, token in zip(drafts, drawn):
        if draft != token:
            break
        n += 1
    return n
