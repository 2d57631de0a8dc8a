"""nn.Linear whose CPU matmul goes through oneDNN rather than the BLAS that torch links (MKL).

Why: MKL's sgemm picks slow code paths on non-Intel CPUs (this project's 2-core AMD EPYC CI machine runs
the lm_head 2x slower through it), while oneDNN dispatches on the CPU's instruction sets. On the SmolLM2
shapes oneDNN is as fast or faster from 1 row up (perf/offline_bench.py has the model-level figures).
INFLIGHT_CPU_GEMM=blas restores torch's default; CUDA tensors never take this path.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

GEMM_ENV = "INFLIGHT_CPU_GEMM"


def _onednn_linear():
    """torch's oneDNN linear op (the one torch.compile uses on CPU), or None where this build lacks it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        op(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")  # some builds register it but fail
        return op
    except (AttributeError, RuntimeError):
        return None


def cpu_gemm_choice() -> str:
    """onednn (default where available) or blas, from INFLIGHT_CPU_GEMM."""
    choice = os.environ.get(GEMM_ENV, "onednn").strip().lower() or "onednn"
    if choice not in ("onednn", "blas"):
        raise ValueError(f"{GEMM_ENV}={choice!r} is not one of onednn, blas")
    return choice if _ONEDNN is not None else "blas"


_ONEDNN = _onednn_linear()


class Linear(nn.Linear):
    """Drop-in nn.Linear; the backend is fixed when the model is built (see use_onednn)."""

    use_onednn = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_onednn and x.dim() == 2 and x.device.type == "cpu":
            return _ONEDNN(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def select_cpu_gemm(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """Point every Linear of the model at oneDNN or BLAS; returns the choice, for the log."""
    use = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_gemm_choice() == "onednn")
    for module in model.modules():
        if isinstance(module, Linear):
            module.use_onednn = use
    return "onednn" if use else ("blas" if device.type == "cpu" else "cuda")
