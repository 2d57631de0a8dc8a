"""Triton-language RMSNorm (optionally fused with the residual add) and SiLU-and-mul for the CUDA path.

Each rounds where the torch modules in llama.py round (the residual sum, the normalised activations, the
SiLU output), so results match them up to the order of the sum of squares. Set TRITON_INTERPRET=1 before
the first import to run them on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)
SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: out = weight * norm(x [+ residual]); the sum also goes to res_out."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded as torch's add in the model dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # llama.py casts before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """Program (row, column block): out = silu(gate) * up, with x = [gate | up] along the last dim."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounds here
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _check(*tensors: torch.Tensor) -> None:
    if not INTERPRETED and not all(t.is_cuda for t in tensors):
        raise RuntimeError("Triton ops need CUDA tensors; to run them on CPU set TRITON_INTERPRET=1 before "
                           "inflight.model.triton_ops is first imported")
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"last dimension must be contiguous, got strides {t.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [tokens, hidden]: (weight * rmsnorm(x + residual), x + residual) with a residual, else (.., None)."""
    _check(x, weight, *([residual] if residual is not None else []))
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        _rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            (res_out if res_out is not None else out).stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * inter] = [gate | up] -> silu(gate) * up [tokens, inter]."""
    _check(x)
    rows, cols2 = x.shape
    cols = cols2 // 2
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(cols))
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](x, out, x.stride(0), out.stride(0), cols, BLOCK=block)
    return out


__all__ = ["INTERPRETED", "rms_norm", "silu_and_mul"]
