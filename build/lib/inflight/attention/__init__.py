"""Paged attention: the torch reference (CPU) and, on CUDA, the Triton-language kernels."""
from __future__ import annotations

import os

import torch

from . import reference as _reference
from .metadata import AttentionMetadata

# auto (default): Triton kernels for CUDA tensors, torch reference otherwise; triton: always the kernels
# (on CPU that needs TRITON_INTERPRET=1 before the first call); torch: always the reference.
BACKEND_ENV = "INFLIGHT_ATTENTION"
_BACKENDS = ("auto", "triton", "torch")
_kernels = None  # inflight.attention.triton_kernels, imported on first use: CPU hosts never pay for triton


def _use_triton(tensor: torch.Tensor) -> bool:
    # Read per call (a dict lookup) so tests and operators can switch without re-importing.
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice == "auto":
        return tensor.is_cuda
    if choice not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={choice!r} is not one of {', '.join(_BACKENDS)}")
    return choice == "triton"


def backend_for(device: torch.device) -> str:
    """'triton' or 'torch': what store_kv / paged_attention run for tensors on this device, as the env says now."""
    return "triton" if _use_triton(torch.empty(0, device=device)) else "torch"


def _triton():
    global _kernels
    if _kernels is None:
        from . import triton_kernels
        _kernels = triton_kernels
    return _kernels


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, plan: dict | None = None) -> None:
    """Write each new token's K/V ([tokens, kv_heads, head_dim]) into its cache slot; slot -1 is skipped.
    plan: the step's AttentionMetadata.reference_plan, where the torch reference keeps per-step work."""
    if _use_triton(key):
        _triton().triton_store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        _reference.store_kv(key, value, k_cache, v_cache, slot_mapping, plan)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (see reference.py)."""
    if _use_triton(query):
        return _triton().triton_paged_attention(query, k_cache, v_cache, meta, scale)
    return _reference.paged_attention(query, k_cache, v_cache, meta, scale)


__all__ = ["AttentionMetadata", "BACKEND_ENV", "backend_for", "paged_attention", "store_kv"]
