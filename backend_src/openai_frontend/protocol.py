"""Parse and check OpenAI request bodies into one GenerationRequest; no Triton and no HTTP in here.

Only type errors and OpenAI features we do not have are refused here. Range checks are left to the model,
whose messages already name the field, the value and the allowed range, so there is one source of truth.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from inflight.fields import BOOL, BY_NAME, FIELDS, FLOAT, INT, Field, InvalidRequestError
from inflight.grammar.spec import BACKENDS

from .errors import bad_request
from .tools import ToolChoice, constraint, parse_tools

# OpenAI body key -> its field in the request schema (the `openai` column), whose kind says the JSON type.
# The vLLM extensions (top_k, min_p, ...) are there too: clients send them through extra_body.
_JSON_TYPES = {INT: "integer", FLOAT: "number", BOOL: "boolean"}
_SAMPLING_FIELDS = {f.openai: f for f in FIELDS if f.openai}

# Chat roles a template understands. "developer" is OpenAI's newer name for "system"; templates predate it.
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class GenerationRequest:
    """One OpenAI request reduced to what the Triton call needs."""
    model: str
    is_chat: bool
    prompt: str = ""  # completions: the prompt; chat: filled in by rendering `messages`
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolChoice = field(default_factory=ToolChoice)
    # chat: extra variables for the model's chat template (vLLM's name), e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    echo: bool = False
    # How many most likely tokens to list per output token when the request asked for logprobs (completions'
    # `logprobs`, chat's `top_logprobs`); None: no logprobs.
    logprobs: int | None = None
    # Contract names -> values, only for what the client set, so the model's own defaults apply otherwise
    # (max_tokens above all: OpenAI's legacy default of 16 would silently truncate).
    sampling: dict[str, Any] = field(default_factory=dict)
    # The body field whose constraint is in sampling["structured_outputs"] (tool_choice for a forced tool call).
    constraint_param: str | None = None
    # chat: the served model's reasoning parser (--reasoning-parser; None: off), whether the generation prompt
    # already ended the reasoning (enable_thinking false), and whether the reply carries the reasoning.
    reasoning_parser: str | None = None
    reasoning_ended: bool = False
    include_reasoning: bool = True

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _typed(name: str, value: Any, kind: str) -> Any:
    if kind == "number":
        if not _is_number(value):
            raise bad_request(f"{name}={value!r} is not a number", name)
        return float(value)
    if kind == "integer":
        # Read exactly (a float holds 53 bits: 2^63-1 would read as 2^63); 5.0 is accepted as 5, 5.5 is not.
        if not _is_number(value) or isinstance(value, float) and not value.is_integer():
            raise bad_request(f"{name}={value!r} is not an integer", name)
        return int(value)
    if kind == "boolean":
        if not isinstance(value, bool):
            raise bad_request(f"{name}={value!r} is not a boolean", name)
        return value
    raise AssertionError(kind)


def _in_openai_range(f: Field, name: str, value: Any) -> Any:
    """Where OpenAI's API declares a narrower type than the model's (seed: int64), its range is checked here; the
    rest of the range checks are the model's."""
    if f.openai_hi is None:
        return value
    try:
        return f.for_openai().parse(value, name)
    except InvalidRequestError as e:
        raise bad_request(str(e), name) from None


def _ask_logprobs(req: GenerationRequest, name: str, value: Any) -> None:
    """Ask the model for its per-token logprobs with `value` alternatives each (the range is the model's field's,
    [0, 20] as vLLM's default max_logprobs, checked here to name the client's own field), and for the sampled ids
    they belong to."""
    try:
        value = BY_NAME["logprobs"].parse(_typed(name, value, "integer"), name)
    except InvalidRequestError as e:
        raise bad_request(str(e), name) from None
    req.logprobs = value
    req.sampling.update(logprobs=value, return_logprobs=True, return_output_ids=True)


def _refuse_if_set(body: dict, name: str, allowed: tuple = (), why: str = "is not supported") -> None:
    """400 when `name` is present with a value other than null or one of `allowed` (its no-op values)."""
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad_request(f"{name}={value!r:.80} {why}", name)


def _common(body: dict, is_chat: bool) -> GenerationRequest:
    model = _model_name(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream={stream!r} is not a boolean", "stream")
    req = GenerationRequest(model=model, is_chat=is_chat, stream=stream)

    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(f"stream_options={options!r} is not an object", "stream_options")
        for key in ("include_usage", "continuous_usage_stats"):
            if not isinstance(options.get(key, False), bool):
                raise bad_request(f"stream_options.{key}={options[key]!r} is not a boolean", "stream_options")
        req.include_usage = options.get("include_usage", False)
        # vLLM's rule: continuous_usage_stats adds to include_usage, it does nothing alone.
        req.continuous_usage = req.include_usage and options.get("continuous_usage_stats", False)

    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by this server", "logit_bias")

    # max_completion_tokens is OpenAI's current name; max_tokens its legacy one. The newer one wins.
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            req.sampling["max_tokens"] = _typed(name, body[name], "integer")
            break
    for name, f in _SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            req.sampling[f.name] = _in_openai_range(f, name, _typed(name, body[name], _JSON_TYPES[f.kind]))

    param, structured = _structured_outputs(body)
    if structured is not None:
        req.sampling["structured_outputs"], req.constraint_param = structured, param

    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request(f"stop={stop!r} must be a string or a list of strings", "stop")
        if stop:
            req.sampling["stop_words"] = stop
    return req


# Other servers' keys for a constraint, each one kind of structured_outputs: vLLM's older extras, llama.cpp's
# json_schema, SGLang's regex and ebnf (xgrammar's EBNF, as here).
_CONSTRAINT_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar", "json_schema": "json", "regex": "regex", "ebnf": "grammar"}
# Other servers' keys about constraints this server cannot honour: refused by name when set, never ignored.
_REFUSED_KEYS = {
    "guided_whitespace_pattern": "is not supported: allowed null (whitespace is free unless structured_outputs sets "
                                 "disable_any_whitespace)",
    "structural_tag": "is not supported (structural tags are not implemented)",
    "grammar_lazy": "is not supported: the grammar applies from the first token",
    "grammar_triggers": "is not supported: the grammar applies from the first token",
}
# TGI's `grammar` object: its type -> our kind.
_TGI_GRAMMAR_TYPES = {"json": "json", "json_object": "json", "regex": "regex"}


def _structured_outputs(body: dict) -> tuple[str | None, dict | None]:
    """The request's one constraint as a structured_outputs object for the model, which checks it (a bad schema
    comes back as a 400 naming it): OpenAI's response_format, vLLM's structured_outputs, or another server's
    field, with the body field that gave it. Two at once are refused; a constraint field that cannot be honoured is
    refused by name."""
    for key, why in _REFUSED_KEYS.items():
        if body.get(key) not in (None, False, [], ""):
            raise bad_request(f"{key}={body[key]!r:.80} {why}", key)
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"guided_decoding_backend={backend!r:.80} is not supported: allowed "
                          f"{', '.join(BACKENDS)} (this server compiles with xgrammar)", "guided_decoding_backend")
    found: list[tuple[str, dict | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", body["structured_outputs"]))
    for key, kind in _CONSTRAINT_KEYS.items():
        if body.get(key) is not None:
            found.append((key, {kind: body[key]}))
    if body.get("grammar") not in (None, ""):
        found.append(("grammar", _grammar_field(body["grammar"])))
    found = [(key, value) for key, value in found if value is not None]  # response_format text: none
    if len(found) > 1:
        raise bad_request(f"{found[0][0]} and {found[1][0]} both constrain the output: give one", found[1][0])
    if not found:
        return None, None
    param, structured = found[0]
    if backend is not None and isinstance(structured, dict) and "backend" not in structured:
        structured = {**structured, "backend": backend}
    return param, structured


def _response_format(fmt: Any) -> dict | None:
    """OpenAI's response_format (None: text); llama.cpp's and TGI's json_object with a `schema` / `value`."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema", fmt.get("value"))
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, dict):
            raise bad_request(f"response_format.schema={schema!r:.80} is invalid: allowed a JSON schema object",
                              "response_format")
        return {"json": schema}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(f"response_format.json_schema={spec!r:.80} is invalid: allowed an object with a "
                              "'schema' object (and 'name', 'strict')", "response_format")
        # strict=false is enforced all the same: the grammar is the only way this server follows a schema.
        return {"json": schema}
    raise bad_request(f"response_format={fmt!r:.80} is not supported: allowed type text, json_object or "
                      "json_schema", "response_format")


def _grammar_field(value: Any) -> dict:
    """`grammar`: TGI's {"type": "json" | "regex", "value": ...} is honoured; llama.cpp's GBNF text is refused:
    GBNF and xgrammar's EBNF differ in details, so it is not taken as one for the other."""
    if isinstance(value, dict) and value.get("type") in _TGI_GRAMMAR_TYPES and value.get("value") is not None:
        return {_TGI_GRAMMAR_TYPES[value["type"]]: value["value"]}
    if isinstance(value, str):
        raise bad_request(f"grammar={value!r:.80} is not supported: llama.cpp's GBNF is not read here; allowed "
                          "xgrammar's EBNF as structured_outputs.grammar (vLLM) or ebnf, a JSON schema as "
                          "json_schema or response_format", "grammar")
    raise bad_request(f"grammar={value!r:.80} is invalid: allowed {{'type': 'json' or 'regex', 'value': ...}} (TGI)",
                      "grammar")


def parse_completion(body: dict) -> GenerationRequest:
    req = _common(body, is_chat=False)
    prompt = body.get("prompt")
    # A list of one string is what some clients send for a single prompt; more would mean several choices.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request(f"prompt={prompt!r:.80} is not supported: allowed a single string "
                          f"(token-id prompts and batches of prompts are not)", "prompt")
    req.prompt = prompt
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad_request(f"echo={echo!r} is not a boolean", "echo")
    req.echo = echo
    if body.get("logprobs") is not None:
        if echo:
            raise bad_request("logprobs with echo=true is not supported: the model reports no logprobs for the "
                              "prompt's tokens; allowed logprobs without echo", "logprobs")
        _ask_logprobs(req, "logprobs", body["logprobs"])
    _refuse_if_set(body, "suffix", allowed=("",), why="is not supported (no fill-in-the-middle)")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request(f"best_of={best_of!r} is not supported: allowed only 1", "best_of")
    return req


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content part of type {kind!r} is not supported: "
                                  f"this model takes text only", "messages")
            parts.append(part["text"])
        # Several text parts read as separate paragraphs, not as one run-on word.
        return "\n".join(parts)
    raise bad_request(f"messages[{i}].content={content!r:.80} must be a string or a list of text parts",
                      "messages")


def _history_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls, checked, arguments as JSON text (OpenAI's form)."""
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls={calls!r:.80} must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"messages[{i}].tool_calls entry {call!r:.80} is invalid: allowed "
                              "{'id', 'type': 'function', 'function': {'name', 'arguments'}}", "messages")
        args = fn.get("arguments", "{}")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def _parse_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> what the chat template reads (roles mapped, text parts joined, tool calls checked)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise bad_request(f"messages[{i}] is not an object", "messages")
        role = msg.get("role")
        if role == "function" or msg.get("function_call"):
            raise bad_request(f"messages[{i}]: the legacy function-calling messages are not supported: allowed "
                              "tool_calls and role 'tool'", "messages")
        if role == "tool":
            out.append({"role": "tool", "content": _message_text(i, msg.get("content")),
                        "tool_call_id": msg.get("tool_call_id")})
            continue
        if role not in _CHAT_ROLES:
            raise bad_request(f"messages[{i}].role={role!r} is not one of {sorted(_CHAT_ROLES) + ['tool']}",
                              "messages")
        content = msg.get("content")
        entry: dict[str, Any] = {"role": _CHAT_ROLES[role],
                                 "content": "" if content is None and msg.get("tool_calls") else
                                 _message_text(i, content)}
        if role == "assistant" and msg.get("tool_calls"):
            entry["tool_calls"] = _history_calls(i, msg["tool_calls"])
        out.append(entry)
    return out


def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request(f"chat_template_kwargs={kwargs!r:.80} must be an object of template variables",
                          "chat_template_kwargs")
    reserved = sorted(set(kwargs or {}) & {"conversation", "messages", "tokenize", "add_generation_prompt", "tools"})
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}: the frontend sets them",
                          "chat_template_kwargs")
    return dict(kwargs or {})


def parse_chat(body: dict) -> GenerationRequest:
    req = _common(body, is_chat=True)
    req.messages = _parse_messages(body.get("messages"))
    _refuse_if_set(body, "functions", allowed=([],), why="is not supported: use tools")
    _refuse_if_set(body, "function_call", allowed=("none",), why="is not supported: use tool_choice")
    req.tools = parse_tools(body)
    forced = constraint(req.tools)
    if forced is not None:
        if "structured_outputs" in req.sampling:
            raise bad_request(f"tool_choice={body.get('tool_choice')!r:.80} and response_format both constrain the "
                              "output: give one", "tool_choice")
        req.sampling["structured_outputs"], req.constraint_param = forced, "tool_choice"
    req.chat_template_kwargs = _template_kwargs(body)
    _reasoning_fields(req, body)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_request(f"modalities={modalities!r} is not supported: allowed only ['text']", "modalities")
    for name in ("audio", "prediction", "web_search_options"):
        _refuse_if_set(body, name)
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"logprobs={logprobs!r:.80} is not a boolean", "logprobs")
    if logprobs:
        if req.tools.active:
            raise bad_request("logprobs with tools is not supported: allowed logprobs without tools", "logprobs")
        _ask_logprobs(req, "top_logprobs", 0 if top is None else top)
    elif top not in (None, 0):
        raise bad_request(f"top_logprobs={top!r:.80} needs logprobs=true: allowed top_logprobs only with logprobs "
                          "true", "top_logprobs")
    return req


# Reasoning fields of other servers this one cannot honour (no effort levels, no thinking budget): refused when set.
_REFUSED_REASONING = {
    "reasoning_effort": "is not supported: this server sets no reasoning effort; allowed null (Qwen3 thinks unless "
                        "chat_template_kwargs has enable_thinking false)",
    "thinking_token_budget": "is not supported: this server does not cap the reasoning; allowed null (max_tokens "
                             "caps the whole reply)",
    "reasoning": "is not supported (OpenRouter's reasoning object): allowed null; include_reasoning and "
                 "chat_template_kwargs.enable_thinking are read",
}


def _reasoning_fields(req: GenerationRequest, body: dict) -> None:
    """vLLM's include_reasoning (honoured where the model has a reasoning parser: app.apply_reasoning)."""
    for name, why in _REFUSED_REASONING.items():
        _refuse_if_set(body, name, why=why)
    include = body.get("include_reasoning")
    if include is not None:
        if not isinstance(include, bool):
            raise bad_request(f"include_reasoning={include!r:.80} is not a boolean", "include_reasoning")
        req.include_reasoning = include


def _model_name(body: Any) -> str:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model={model!r} must be a non-empty string naming a served model", "model")
    return model


@dataclass
class TokenizeRequest:
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""
    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolChoice = field(default_factory=ToolChoice)


def parse_tokenize(body: Any) -> TokenizeRequest:
    req = TokenizeRequest(model=_model_name(body))
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise bad_request("prompt and messages were both given: allowed one of them", "prompt")
        req.messages = _parse_messages(body["messages"])
        add = body.get("add_generation_prompt", True)
        if not isinstance(add, bool):
            raise bad_request(f"add_generation_prompt={add!r} is not a boolean", "add_generation_prompt")
        req.add_generation_prompt = add
        req.chat_template_kwargs = _template_kwargs(body)
        req.tools = parse_tools(body)
        return req
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt or messages is required", "prompt")
    if not isinstance(prompt, str):
        raise bad_request(f"prompt={prompt!r:.80} is not a string: allowed a string, or messages", "prompt")
    req.prompt = prompt
    return req


def parse_detokenize(body: Any) -> tuple[str, list[int]]:
    """(model, token ids); each id an integer (its range is the tokenizer's, checked where it is loaded)."""
    model = _model_name(body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request(f"tokens={tokens!r:.80} is not a list: allowed a list of token ids", "tokens")
    ids = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request(f"tokens[{i}]={t!r:.40} is not an integer: allowed a token id", "tokens")
        ids.append(t)
    return model, ids
