"""Tool calling on /v1/chat/completions: the constraint a tool choice puts on the output, how tools reach a chat
template that does not know them, and reading tool calls back out of the model's text, whole or streamed.

tool_choice "required" and a named function are enforced by a grammar built from the functions' parameter
schemas (the engine's structured output), so the output parses whatever the model: a named function's output is
its arguments object; "required" outputs a JSON list of {"name", "arguments"} (at most one with
parallel_tool_calls false). "auto" leaves the model free and reads Hermes-style blocks from its text:
<tool_call>{"name": ..., "arguments": {...}}</tool_call> (the format Qwen2.5, Hermes and our fallback prompt use).
A block is a call when its JSON is a call (a block the output ended inside too, if its JSON is whole); every other
character is content, except whitespace before a call and, when there were calls, at either end of the content.
Whole and streamed replies are read by the same reader, so they agree however the text was cut into deltas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolChoice:
    """The request's tools and what it asked of them. mode: none, auto, required or named (then `name`)."""
    tools: list[dict[str, Any]] = field(default_factory=list)  # the "function" objects, in request order
    mode: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    def function(self, name: str) -> dict[str, Any]:
        return next(f for f in self.tools if f["name"] == name)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parameters_of(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def constraint(choice: ToolChoice) -> dict[str, Any] | None:
    """The structured_outputs object (vLLM's form) that enforces the choice; None for auto and none."""
    if not choice.active or choice.mode == "auto":
        return None
    if choice.mode == "named":
        return {"json": parameters_of(choice.function(choice.name))}
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _embedded(i, f)},
              "required": ["name", "arguments"]} for i, f in enumerate(choice.tools)]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not choice.parallel:
        schema["maxItems"] = 1
    return {"json": schema}


def _embedded(i: int, function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters inside the list of calls, as a resource of its own (an `$id`: JSON Schema's
    embedded schemas), so that its references ("#/$defs/...", "#") still name its own definitions there."""
    params = parameters_of(function)
    return params if "$id" in params else {"$id": f"tool-{i}.json", **params}


def tools_system_prompt(choice: ToolChoice) -> str:
    """For a chat template that takes no `tools`: the functions and the call format, as a system message."""
    specs = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in choice.tools)
    return ("You may call functions to answer. These are the functions, as JSON schemas:\n<tools>\n" + specs +
            "\n</tools>\nTo call one, write a JSON object with the function's name and arguments inside tags, one "
            'block per call:\n<tool_call>\n{"name": "function name", "arguments": {"argument": "value"}}\n'
            "</tool_call>")


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _parse_block(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _open_prefix_length(text: str) -> int:
    """How long a tail of `text` could still grow into "<tool_call>" (0: none)."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-k:])), 0)


def parse_output(choice: ToolChoice, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of one whole choice's text."""
    if not choice.active:
        return text, []
    if choice.mode == "named":
        return None, [call(choice.name, text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (length): the client gets what there is
        return None, [call(i["name"], json.dumps(i["arguments"], ensure_ascii=False)) for i in items]
    reader = ToolStream(choice)
    deltas = reader.feed(text) + reader.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [{k: v for k, v in tc.items() if k != "index"} for d in deltas for tc in d.get("tool_calls", [])]
    return (content or None) if calls else content, calls


def finish_reason(reason: str, calls: list) -> str:
    """OpenAI's finish reason for a choice that made tool calls: tool_calls, unless it was cut short."""
    return "tool_calls" if calls and reason == "stop" else reason


class ToolStream:
    """One choice's streamed text -> chat delta objects (content and tool_calls), as OpenAI streams them."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.buffer = ""  # held back: text that may be (the start of) a tool call
        self.text = ""  # the whole text so far (required: parsed at the end)
        self.num_calls = 0
        self._named_started = False
        self._content_sent = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.text += text
        mode = self.choice.mode
        if not self.choice.active:
            return [{"content": text}]
        if mode == "named":  # the arguments stream as they come
            delta = {"index": 0, "function": {"arguments": text}}
            if not self._named_started:
                self._named_started, self.num_calls = True, 1
                delta = {"index": 0, **call(self.choice.name, text)}
            return [{"tool_calls": [delta]}]
        if mode == "required":
            return []
        return self._auto(text)

    def _auto(self, text: str) -> list[dict[str, Any]]:
        """Content up to what may still become a call; each whole block, as a call or (unparseable) as content."""
        self.buffer += text
        out: list[dict[str, Any]] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                self._content(out, self._take_text(len(self.buffer) - _open_prefix_length(self.buffer)))
                return out
            end = self.buffer.find(CLOSE, start + len(OPEN))
            if end < 0:  # the block goes on in later deltas
                self._content(out, self._take_text(start))
                return out
            stop = end + len(CLOSE)
            parsed = _parse_block(self.buffer[start + len(OPEN):end].strip())
            if parsed is None:
                self._content(out, self.buffer[:stop])
            else:
                self._content(out, self.buffer[:start].rstrip())
                self._call(out, parsed)
            self.buffer = self.buffer[stop:]

    def _take_text(self, upto: int) -> str:
        """The buffer's text before `upto`, taken out of it, less its trailing whitespace: that stays held, as a
        call may follow it (and takes it away)."""
        text = self.buffer[:upto].rstrip()
        self.buffer = self.buffer[len(text):]
        return text

    def _content(self, out: list[dict[str, Any]], text: str) -> None:
        if self.num_calls and not self._content_sent:
            text = text.lstrip()  # content that starts after a call starts at its first word
        if text:
            out.append({"content": text})
            self._content_sent = True

    def _call(self, out: list[dict[str, Any]], parsed: dict[str, Any]) -> None:
        out.append({"tool_calls": [{"index": self.num_calls, **parsed}]})
        self.num_calls += 1

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held back, at the choice's end."""
        if self.choice.mode == "required" and self.choice.active:
            _, calls = parse_output(self.choice, self.text)
            if not calls:
                return [{"content": self.text}] if self.text else []
            self.num_calls = len(calls)
            return [{"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}]
        rest, self.buffer = self.buffer, ""
        if self.choice.mode != "auto" or not self.choice.active:
            return []
        out: list[dict[str, Any]] = []
        block = rest.lstrip()
        if block.startswith(OPEN):  # the output ended inside a block: a call if its JSON is whole, else text
            parsed = _parse_block(block[len(OPEN):].strip())
            if parsed is not None:
                self._call(out, parsed)
                rest = ""
        self._content(out, rest.rstrip() if self.num_calls else rest)
        return out


def parse_tools(body: dict) -> ToolChoice:
    """tools, tool_choice and parallel_tool_calls of a chat body, checked (400 naming the field)."""
    from inflight.grammar.schema_check import unsupported_keyword  # the engine's own check, named for tools

    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request(f"tools={tools!r:.80} must be a list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}]={tool!r:.80} is not supported: allowed "
                              "{'type': 'function', 'function': {...}}", "tools")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise bad_request(f"tools[{i}].function.name={fn.get('name')!r} is invalid: allowed 1-64 letters, "
                              "digits, _ . -", "tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"tools[{i}].function.parameters={params!r:.80} is invalid: allowed a JSON "
                                  "schema object", "tools")
            bad = unsupported_keyword(params)
            if bad is not None:
                raise bad_request(f"tools[{i}].function.parameters: schema keyword {bad[0]!r} at {bad[1] or '/'} "
                                  f"is not supported: {bad[2]}", "tools")
        functions.append({k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request(f"tools names {names} repeat: allowed distinct function names", "tools")
    raw = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls={parallel!r} is not a boolean", "parallel_tool_calls")
    if raw is None:
        raw = "auto" if functions else "none"
    if raw in ("none", "auto", "required"):
        if raw != "none" and not functions:
            raise bad_request(f"tool_choice={raw!r} needs tools: allowed 'none' without tools", "tool_choice")
        return ToolChoice(functions, raw, None, parallel)
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise bad_request(f"tool_choice={raw!r:.80} is invalid: allowed 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools: allowed {names}",
                          "tool_choice")
    return ToolChoice(functions, "named", name, parallel)
