"""Render chat messages into one prompt with the model's own chat template (from its tokenizer folder)."""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from .errors import APIError, bad_request
from .tools import CLOSE, OPEN, ToolChoice, tools_system_prompt

log = logging.getLogger(__name__)


class ChatTemplates:
    """Loads each tokenizer once (lazily: a model that is only used for completions never pays for it)."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._lock = threading.Lock()  # loading runs in worker threads; two requests must not load twice

    def _tokenizer(self, path: str) -> Any:
        with self._lock:
            tok = self._tokenizers.get(path)
            if tok is None:
                from transformers import AutoTokenizer  # deferred: a 2-3 s import the CLI --help need not pay

                tok = AutoTokenizer.from_pretrained(path)
                self._tokenizers[path] = tok
            return tok

    def preload(self, path: str) -> None:
        self._tokenizer(path)

    def tokenizer(self, model: str, tokenizer_dir: str | None) -> Any:
        """The model's tokenizer (blocking on first use); 400 when its folder is unknown."""
        if tokenizer_dir is None:
            raise APIError(400, f"model {model!r} has no tokenizer folder known to this server: start the frontend "
                                f"with --tokenizer {model}=DIR", param="model", code="no_tokenizer")
        return self._tokenizer(tokenizer_dir)

    def encode(self, model: str, tokenizer_dir: str | None, text: str) -> list[int]:
        """The token ids the engine makes of `text` sent as a prompt (inflight/prompt.py): the tokenizer's special
        tokens are added unless the text already begins with the BOS token (a rendered chat template)."""
        tok = self.tokenizer(model, tokenizer_dir)
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(text, add_special_tokens=not (bos and text.startswith(bos))))

    def decode(self, model: str, tokenizer_dir: str | None, ids: list[int]) -> str:
        """`ids` as text, special tokens included (vLLM's /detokenize); each id must be in the vocabulary."""
        tok = self.tokenizer(model, tokenizer_dir)
        vocab = len(tok)
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise bad_request(f"tokens[{i}]={t} is out of range: allowed a token id in [0, {vocab}) "
                                  f"(the vocabulary of {model!r})", "tokens")
        return tok.decode(ids)

    def render(self, model: str, tokenizer_dir: str | None, messages: list[dict[str, Any]],
               tools: ToolChoice | None = None, template_kwargs: dict[str, Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        """Blocking (first call loads the tokenizer): call it from a worker thread. template_kwargs: variables the
        template reads beyond the messages (the request's chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        if tokenizer_dir is None:
            raise APIError(400, f"model {model!r} has no tokenizer folder known to this server, so its chat "
                                f"template is unknown: start the frontend with --tokenizer {model}=DIR, or "
                                f"use /v1/completions", param="model", code="no_chat_template")
        tok = self._tokenizer(tokenizer_dir)
        if not getattr(tok, "chat_template", None):
            raise APIError(400, f"model {model!r} has no chat template: use /v1/completions", param="model",
                           code="no_chat_template")
        kwargs: dict[str, Any] = {}
        uses_tools = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if tools is not None and tools.active or uses_tools:
            if "tools" in tok.chat_template:  # the template renders tools and tool messages its own way
                if tools is not None and tools.active:
                    kwargs["tools"] = [{"type": "function", "function": f} for f in tools.tools]
                messages = [_with_dict_arguments(m) for m in messages]
            else:
                messages = hermes_messages(messages, tools if tools is not None and tools.active else None)
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **{**(template_kwargs or {}), **kwargs})
        except Exception as e:  # noqa: BLE001 - templates raise their own errors for message orders they refuse
            raise bad_request(f"the chat template of {model!r} refused these messages: {e}", "messages") from e


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Templates that take tool calls expect their arguments as a mapping (they serialise it themselves)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        try:
            args = json.loads(c["function"]["arguments"])
        except (json.JSONDecodeError, TypeError):
            args = c["function"]["arguments"]
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
    return {**message, "tool_calls": calls}


def hermes_messages(messages: list[dict[str, Any]], tools: ToolChoice | None) -> list[dict[str, Any]]:
    """For a template that knows only system/user/assistant text (SmolLM2's): the tools as a system message,
    earlier calls as <tool_call> blocks in the assistant's text, results as <tool_response> user messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            blocks = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                 "arguments": _loads(c["function"]["arguments"])},
                                                ensure_ascii=False) + f"\n{CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content") or "", *blocks]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads(text: Any) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
