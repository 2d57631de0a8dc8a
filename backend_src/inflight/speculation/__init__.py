"""Speculative decoding without a draft model: proposers (n-gram prompt lookup), the policy of when to draft, and
the verification rule. The scheduler, runner and engine carry the drafts through one forward and roll back what
was rejected; docs/speculative.md describes the whole path."""
from .ngram import NgramProposer
from .proposer import Proposer
from .speculator import Speculator, resolve_method
from .verify import DraftPosition, num_accepted, verification_rows

__all__ = ["DraftPosition", "NgramProposer", "Proposer", "Speculator", "num_accepted", "resolve_method",
           "verification_rows"]
