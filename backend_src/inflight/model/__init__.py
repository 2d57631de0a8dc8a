"""The model families (families.py), their shared config and the weight loader."""
from .config import ModelConfig, UnsupportedModelError
from .families import FAMILIES, model_class
from .llama import LlamaForCausalLM
from .loader import load_model

__all__ = ["FAMILIES", "LlamaForCausalLM", "ModelConfig", "UnsupportedModelError", "load_model", "model_class"]
