"""OpenAI response bodies and SSE chunks for completions and chat, built from the model's deltas."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .protocol import GenerationRequest

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    # ensure_ascii=False: multi-byte text goes out as UTF-8 rather than \u escapes (smaller, same meaning).
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(num_input: int | None, num_output: int | None) -> dict[str, int]:
    p, c = num_input or 0, num_output or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class ResponseBuilder:
    """Holds what every body of one request shares (id, created, model) and shapes each kind of body."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.id = ("chatcmpl-" if req.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def _stream_head(self) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.req.is_chat else "text_completion")
        if self.req.include_usage:
            head["usage"] = None  # OpenAI sends usage: null on every chunk but the usage chunk
        return head

    def role_chunk(self, index: int = 0) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role and no content, as OpenAI's do."""
        return {**self._stream_head(), "choices": [
            {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, text: str, finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
        if self.req.is_chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._stream_head(), "choices": [choice]}

    def delta_chunk(self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
        """A chat chunk with any delta (content, tool_calls)."""
        return {**self._stream_head(), "choices": [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def usage_chunk(self, usage_block: dict[str, int]) -> dict[str, Any]:
        return {**self._stream_head(), "choices": [], "usage": usage_block}

    def full(self, choices: list[tuple[str | None, str, list[dict[str, Any]]]],
             usage_block: dict[str, int]) -> dict[str, Any]:
        """choices: (text, finish reason, tool calls) per sample, in index order."""
        if self.req.is_chat:
            body = [{"index": i, "message": {"role": "assistant", "content": text,
                                             **({"tool_calls": calls} if calls else {})},
                     "logprobs": None, "finish_reason": reason} for i, (text, reason, calls) in enumerate(choices)]
            head = self._head("chat.completion")
        else:
            body = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                    for i, (text, reason, _) in enumerate(choices)]
            head = self._head("text_completion")
        return {**head, "choices": body, "usage": usage_block}
