"""Render chat messages into one prompt with the model's own chat template (from its tokenizer folder)."""
from __future__ import annotations

import logging
import threading
from typing import Any

from .errors import APIError, bad_request

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

    def render(self, model: str, tokenizer_dir: str | None, messages: list[dict[str, str]],
               template_kwargs: dict[str, Any] | None = None) -> str:
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
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - templates raise their own errors for message orders they refuse
            raise bad_request(f"the chat template of {model!r} refused these messages: {e}", "messages") from e
