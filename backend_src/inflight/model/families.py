"""Which module builds each family (ModelConfig.family): one file per family, sharing llama.py's layer where it
can. Adding a family: a config parse in config.py, a module here, and its fidelity test (docs/models.md)."""
from __future__ import annotations

from .config import ModelConfig
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM

FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,  # llama, qwen2, mistral
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    return FAMILIES[cfg.family]
