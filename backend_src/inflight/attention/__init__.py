"""Paged attention: the torch reference (CPU) and, on CUDA, the Triton-language kernels."""
from __future__ import annotations

import torch

from ..env_overrides import ATTENTION_ENV as BACKEND_ENV  # noqa: F401 - the name perf/gpu/bench.py imports
from . import reference as _reference
from .metadata import AttentionMetadata

# backend (the engine option attention_backend, resolved at load by cpu_defaults.py and held by each attention
# layer): auto, Triton kernels for CUDA tensors and the torch reference otherwise; triton: always the kernels
# (on CPU that needs TRITON_INTERPRET=1 before the first call); torch: always the reference.
_BACKENDS = ("auto", "triton", "torch")
_kernels = None  # inflight.attention.triton_kernels, imported on first use: CPU hosts never pay for triton


def _use_triton(tensor: torch.Tensor, backend: str) -> bool:
    if backend == "auto":
        return tensor.is_cuda
    if backend not in _BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is out of range: allowed {', '.join(_BACKENDS)}")
    return backend == "triton"


def _triton():
    global _kernels
    if _kernels is None:
        from . import triton_kernels
        _kernels = triton_kernels
    return _kernels


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, plan: dict | None = None, backend: str = "auto") -> None:
    """Write each new token's K/V ([tokens, kv_heads, head_dim]) into its cache slot; slot -1 is skipped.
    plan: the step's AttentionMetadata.reference_plan, where the torch reference keeps per-step work."""
    if _use_triton(key, backend):
        _triton().triton_store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        _reference.store_kv(key, value, k_cache, v_cache, slot_mapping, plan)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, backend: str = "auto", window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (see reference.py); window > 0:
    each query sees only the last `window` positions (itself included)."""
    if _use_triton(query, backend):
        return _triton().triton_paged_attention(query, k_cache, v_cache, meta, scale, window=window)
    return _reference.paged_attention(query, k_cache, v_cache, meta, scale, window=window)


__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
