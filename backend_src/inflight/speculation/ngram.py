"""Prompt lookup (vLLM's `ngram` method, llama.cpp's lookup decoding): find the sequence's last n tokens earlier in
its own prompt or output and propose what followed them there.

Per sequence an index maps every n-gram (n in [prompt_lookup_min, prompt_lookup_max]) to the position right after
its latest occurrence. Tokens are only ever appended, so the index grows by the step's new tokens: a proposal
costs a few dictionary look-ups however long the sequence is, not a scan of it.
"""
from __future__ import annotations

import weakref

from ..sequence import Sequence


class _Index:
    __slots__ = ("by_size", "num_indexed")

    def __init__(self, sizes: range):
        self.by_size: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.num_indexed = 0  # continuation starts below this are in the maps


class NgramProposer:
    """Longest match first (prompt_lookup_max down to prompt_lookup_min), its latest occurrence: where text is
    being copied, the most recent place is the likeliest to continue the same way."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}: "
                             "allowed 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.sizes = range(prompt_lookup_max, prompt_lookup_min - 1, -1)
        self._indexes: weakref.WeakKeyDictionary[Sequence, _Index] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = seq.token_ids
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = _Index(self.sizes)
        self._extend(index, tokens)
        end = len(tokens)
        for n in self.sizes:
            if end > n:
                start = index.by_size[n].get(tuple(tokens[end - n:]))
                if start is not None:
                    break
        else:
            return []
        # What followed the match, as far as max_tokens. A match close to the end runs out of tokens to copy: the
        # copy then continues into the draft itself (a repeating pattern is proposed to go on repeating).
        draft: list[int] = []
        for j in range(max_tokens):
            pos = start + j
            draft.append(tokens[pos] if pos < end else draft[pos - end])
        return draft

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Index the n-grams followed by at least one token: continuation starts up to len(tokens) - 1, so the
        sequence's own suffix is never found as a match of itself."""
        by_size = index.by_size
        for start in range(index.num_indexed, len(tokens)):
            for n, table in by_size.items():
                if start >= n:
                    table[tuple(tokens[start - n:start])] = start
        index.num_indexed = len(tokens)

    def forget(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)
