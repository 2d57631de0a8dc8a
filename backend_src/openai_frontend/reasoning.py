"""Reasoning parsers for /v1/chat/completions (vLLM's --reasoning-parser): split a choice's text into its
reasoning and its content, whole or streamed.

qwen3, as vLLM's current qwen3 parser reads Qwen3's <think>...</think>:
- the text before the first </think> is reasoning, the text after it is content (null when empty); a <think>
  before that is dropped (the original Qwen3 template lets the model write it; later ones put it in the prompt);
- no </think> at all: the whole text is reasoning and content is null (the output was cut, or is still thinking);
- reasoning already over before the model starts (the generation prompt closes the block, as Qwen3's template does
  for chat_template_kwargs {"enable_thinking": false}, or the request says enable_thinking false): no reasoning
  (null), the whole text is content.
Tags are found in the text, so a tag cut across deltas is held back until the next delta says what it is; whole and
streamed replies go through the same reader, so the streamed pieces join into the whole reply's fields.
"""
from __future__ import annotations

from typing import Any

PARSERS = ("qwen3",)  # the names --reasoning-parser takes
OPEN, CLOSE = "<think>", "</think>"
REASONING, CONTENT = "reasoning", "content"


def prompt_ends_reasoning(generation_prompt: str, template_kwargs: dict[str, Any] | None = None) -> bool:
    """Whether the model starts after its reasoning: the generation prompt (what the template adds after the
    messages) closes a think block, or the request turned thinking off. Earlier turns' blocks do not count."""
    if (template_kwargs or {}).get("enable_thinking") is False:
        return True
    return generation_prompt.rfind(CLOSE) > generation_prompt.rfind(OPEN)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How long a tail of `text` could still grow into one of `tags` (0: none)."""
    longest = max(len(t) for t in tags) - 1
    return next((k for k in range(min(longest, len(text)), 0, -1) if any(t.startswith(text[-k:]) for t in tags)), 0)


class ReasoningStream:
    """One choice's text -> (kind, text) pieces, kind REASONING or CONTENT, in order."""

    def __init__(self, ended: bool = False):
        self.ended_at_start = ended
        self.in_reasoning = not ended
        self.opened = False  # a <think> was dropped
        self.closed = False  # a </think> ended the reasoning
        self.buffer = ""  # held back: the start of what may be a tag

    def feed(self, text: str) -> list[tuple[str, str]]:
        if not self.in_reasoning:
            return [(CONTENT, text)] if text else []
        self.buffer += text
        out: list[tuple[str, str]] = []
        while True:
            start = -1 if self.opened else self.buffer.find(OPEN)
            end = self.buffer.find(CLOSE)
            if start >= 0 and (end < 0 or start < end):
                self._emit(out, REASONING, self.buffer[:start])
                self.buffer, self.opened = self.buffer[start + len(OPEN):], True
                continue
            if end >= 0:
                self._emit(out, REASONING, self.buffer[:end])
                rest, self.buffer = self.buffer[end + len(CLOSE):], ""
                self.in_reasoning, self.closed = False, True
                self._emit(out, CONTENT, rest)
                return out
            keep = _held(self.buffer, (CLOSE,) if self.opened else (OPEN, CLOSE))
            self._emit(out, REASONING, self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, at the choice's end: a tag that never completed is reasoning text."""
        out: list[tuple[str, str]] = []
        self._emit(out, REASONING, self.buffer)
        self.buffer = ""
        return out

    @staticmethod
    def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def split(text: str, ended: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of one whole choice's text; the streamed pieces of the same text join into these."""
    reader = ReasoningStream(ended)
    pieces = reader.feed(text) + reader.finish()
    return joined(reader, pieces)


def joined(reader: ReasoningStream, pieces: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    """The fields a whole reply carries for all of a reader's pieces."""
    reasoning = "".join(t for kind, t in pieces if kind == REASONING)
    content = "".join(t for kind, t in pieces if kind == CONTENT)
    if reader.ended_at_start:
        return None, content
    return reasoning, (content or None) if reader.closed else None
