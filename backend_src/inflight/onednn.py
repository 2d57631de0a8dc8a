"""torch's oneDNN linear op, probed once at import: the op model/linear.py multiplies with, and whether this torch
build has one, which cpu_defaults.py reads to resolve cpu_gemm. Below both, so that cpu_defaults.py asks without
importing the Linear it configures (linear.py reads the resolved switches)."""
from __future__ import annotations

import torch


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


ONEDNN_LINEAR = _onednn_linear()


def onednn_available() -> bool:
    """Whether this torch build has a working oneDNN linear (cpu_defaults.py resolves cpu_gemm with it)."""
    return ONEDNN_LINEAR is not None
