"""n > 1 streamed through the OpenAI frontend, without a server: Triton's responses carry an element per sample,
the finished ones included (vLLM's layout), and each choice must still finish exactly once."""
from __future__ import annotations

import asyncio
import collections
import json

from openai_frontend.app import _stream_body
from openai_frontend.protocol import parse_chat, parse_completion
from openai_frontend.responses import ResponseBuilder
from openai_frontend.triton_io import Delta

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def stream_events(req, responses: list[list[Delta]]) -> list[dict]:
    """The SSE events the frontend writes for these Triton responses (the first is awaited before the body)."""
    async def model():
        for response in responses[1:]:
            yield response

    async def collect():
        body = _stream_body(ResponseBuilder(req), req, responses[0], model())
        return [event async for event in body]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def per_sample(*columns: tuple[str, str | None]) -> list[Delta]:
    """One Triton response: (text, finish reason) per sample, in index order."""
    return [Delta(text, reason, 4, len(text), i) for i, (text, reason) in enumerate(columns)]


# Sample 2 finishes first; every later response repeats its finish (with no text), as the model sends it.
EARLY_FINISH = [
    per_sample(("a", None), ("b", None), ("c", "length")),
    per_sample((" a2", None), (" b2", "eos"), ("", "length")),
    per_sample(("", "eos"), ("", "eos"), ("", "length")),
]


def test_each_completion_choice_finishes_once_with_its_own_text():
    req = parse_completion({"model": "m", "prompt": "p", "n": 3, "stream": True})
    choices = [c for e in stream_events(req, EARLY_FINISH) for c in e["choices"]]
    finishes = collections.Counter((c["index"], c["finish_reason"]) for c in choices if c["finish_reason"])
    assert finishes == {(0, "stop"): 1, (1, "stop"): 1, (2, "length"): 1}
    texts = collections.defaultdict(str)
    for c in choices:
        texts[c["index"]] += c["text"]
    assert dict(texts) == {0: "a a2", 1: "b b2", 2: "c"}


def test_each_chat_choice_finishes_once_and_usage_counts_each_token_once():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3, "stream": True,
                      "stream_options": {"include_usage": True}})
    events = stream_events(req, EARLY_FINISH)
    choices = [c for e in events for c in e["choices"]]
    finishes = collections.Counter((c["index"], c["finish_reason"]) for c in choices if c["finish_reason"])
    assert finishes == {(0, "stop"): 1, (1, "stop"): 1, (2, "length"): 1}
    assert events[-1]["usage"]["completion_tokens"] == len("a a2") + len("b b2") + len("c")


def test_a_required_tool_call_of_an_early_choice_is_sent_once():
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True,
                      "tools": [WEATHER], "tool_choice": "required"})
    events = stream_events(req, [per_sample((call, "eos"), ('[{"name": ', None)),
                                 per_sample(("", "eos"), ('"get_weather", "arguments": ', None)),
                                 per_sample(("", "eos"), ('{"city": "Oslo"}}]', "eos"))])
    arguments = collections.defaultdict(str)
    finishes = collections.Counter()
    for choice in (c for e in events for c in e["choices"]):
        for tool_call in choice["delta"].get("tool_calls", []):
            arguments[choice["index"]] += tool_call["function"]["arguments"]
        if choice["finish_reason"]:
            finishes[choice["index"], choice["finish_reason"]] += 1
    assert json.loads(arguments[0]) == {"city": "Paris"} and json.loads(arguments[1]) == {"city": "Oslo"}
    assert finishes == {(0, "tool_calls"): 1, (1, "tool_calls"): 1}
