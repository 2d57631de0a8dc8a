"""Structured output: what a request constrains its output to (spec), compiled grammars cached and compiled off
the engine thread (compiler), and the per-step token bitmask of the constrained rows (bitmask)."""
from .spec import GrammarSpec, spec_of

__all__ = ["GrammarSpec", "spec_of"]
