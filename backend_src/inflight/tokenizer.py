"""The tokenizer of a model path: a Hugging Face folder's files, or for a GGUF file the Hugging Face tokenizer files
beside it where there are some (our model folders hold both), else the one transformers builds from the GGUF."""
from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_dir(model: str) -> str:
    """The folder whose tokenizer files serve `model` (a GGUF's own folder for a GGUF file)."""
    return os.path.dirname(os.path.abspath(model)) if str(model).endswith(".gguf") else str(model)


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    folder = tokenizer_dir(model)
    if str(model).endswith(".gguf") and not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(folder, gguf_file=os.path.basename(model))
    return AutoTokenizer.from_pretrained(folder)
