"""OpenAI response bodies and SSE chunks for completions and chat, built from the model's deltas."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .protocol import GenerationRequest
from .triton_io import TokenLogprob

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    # ensure_ascii=False: multi-byte text goes out as UTF-8 rather than \u escapes (smaller, same meaning).
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(num_input: int | None, num_output: int | None, num_cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage block; prompt_tokens_details.cached_tokens when the model reported its prefix-cache hits."""
    p, c = num_input or 0, num_output or 0
    block: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if num_cached is not None:
        block["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return block


def _top(t: TokenLogprob, n: int) -> list[tuple[str, float]]:
    return [(text, lp) for text, lp, rank in t.top if rank <= n][:n]


def chat_logprobs(tokens: list[TokenLogprob], n: int) -> dict[str, Any]:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the n most likely tokens of its step."""
    def entry(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(x, lp) for x, lp in _top(t, n)]}
                        for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob], n: int, offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions shape; top_logprobs also holds the sampled token when it is not among the n
    (so up to n + 1 entries, as OpenAI's and vLLM's); text_offset counts characters from `offset`."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{**dict(_top(t, n)), t.token: t.logprob} for t in tokens], "text_offset": offsets}


def reasoning_fields(text: str | None) -> dict[str, Any]:
    """A chat message's or delta's reasoning, under vLLM's current name and its earlier one (reasoning_content),
    which clients still read."""
    return {"reasoning_content": text, "reasoning": text}


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

    def chunk(self, text: str, finish_reason: str | None = None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.req.is_chat:
            delta = {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._stream_head(), "choices": [choice]}

    def logprobs(self, tokens: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
        """The request's logprobs block for these tokens (None when it asked for none)."""
        if self.req.logprobs is None or tokens is None:
            return None
        if self.req.is_chat:
            return chat_logprobs(tokens, self.req.logprobs)
        return completion_logprobs(tokens, self.req.logprobs, offset)

    def delta_chunk(self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A chat chunk with any delta (content, tool_calls, reasoning)."""
        return {**self._stream_head(), "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def usage_chunk(self, usage_block: dict[str, Any]) -> dict[str, Any]:
        return {**self._stream_head(), "choices": [], "usage": usage_block}

    def full(self, choices: list[tuple[str | None, str, list[dict[str, Any]]]], usage_block: dict[str, Any],
             logprobs: list[list[TokenLogprob] | None] | None = None,
             reasoning: list[str | None] | None = None) -> dict[str, Any]:
        """choices: (text, finish reason, tool calls) per sample, in index order; logprobs: each one's tokens;
        reasoning: each one's reasoning when the model has a reasoning parser (None: no reasoning fields)."""
        blocks = [self.logprobs(lps) for lps in logprobs] if logprobs else [None] * len(choices)
        if self.req.is_chat:
            body = [{"index": i, "message": {"role": "assistant", "content": text,
                                             **(reasoning_fields(reasoning[i]) if reasoning is not None else {}),
                                             **({"tool_calls": calls} if calls else {})},
                     "logprobs": blocks[i], "finish_reason": reason} for i, (text, reason, calls) in enumerate(choices)]
            head = self._head("chat.completion")
        else:
            body = [{"index": i, "text": text, "logprobs": blocks[i], "finish_reason": reason}
                    for i, (text, reason, _) in enumerate(choices)]
            head = self._head("text_completion")
        return {**head, "choices": body, "usage": usage_block}
