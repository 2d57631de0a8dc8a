"""Prompt text -> token ids, with the one check on prompt text: non-empty, and not so long that it could
never fit max_model_len. Shared by the engine and the dynamic arm's preprocessing, which tokenizes alone."""
from __future__ import annotations

from .fields import InvalidRequestError, Shown, refuse


class PromptEncoder:
    """Text that cannot fit is refused before the tokenizer sees it (a 1 MiB prompt costs seconds of
    tokenizing): no prompt of max_model_len tokens is longer than max_model_len of the longest token, x2 for
    normalizers that drop characters. The cap is the smaller of that and the configured max_prompt_bytes.
    The tokenizer must be used from one thread at a time (Rust tokenizers are not shareable)."""

    def __init__(self, tokenizer, max_model_len: int, max_prompt_bytes: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_bytes = max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(len(tokenizer)))
        self.configured_bytes = max_prompt_bytes
        self.max_prompt_bytes = min(max_prompt_bytes, 2 * max_model_len * self.max_token_bytes)

    def _starts_with_bos(self, prompt: str) -> bool:
        bos = getattr(self.tokenizer, "bos_token", None)
        return bool(bos) and prompt.startswith(bos)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of `prompt`; chat=True: of the model's chat template rendered around it as one user
        message, ending where the assistant's answer begins."""
        if not prompt:
            raise InvalidRequestError("text_input='' is empty: allowed a non-empty prompt")
        if chat and not self.has_chat_template:
            raise InvalidRequestError("apply_chat_template=True is not allowed: this model has no chat template; "
                                      "allowed false (send the prompt as raw text)")
        # Characters are a lower bound of bytes: only text that might fit is encoded to count its bytes.
        num_bytes = len(prompt) if len(prompt) > self.max_prompt_bytes else len(prompt.encode("utf-8"))
        if num_bytes > self.max_prompt_bytes:
            raise refuse("text_input", Shown(f"<{num_bytes} bytes>"),
                         f"at most {self.max_prompt_bytes} bytes (the smaller of max_prompt_bytes="
                         f"{self.configured_bytes} and max_model_len={self.max_model_len} tokens of at most "
                         f"{self.max_token_bytes} bytes, x2)", "is out of range")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template has its own markers
        elif self._starts_with_bos(prompt):
            # Text rendered by a chat template elsewhere (the OpenAI frontend) already begins with the BOS
            # token; the tokenizer would add a second one, which models such as Gemma answer worse with.
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequestError("text_input has 0 tokens: allowed a prompt of at least 1 token")
        return ids
