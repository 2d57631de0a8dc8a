"""Paged attention: the torch reference (CPU) and, on CUDA, the Triton-language kernels."""
from .metadata import AttentionMetadata
from .reference import paged_attention, store_kv

__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
