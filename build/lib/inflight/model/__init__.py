"""Llama-family model and its weight loader."""
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .loader import load_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model"]
