"""Kernel tests run the Triton interpreter on CPU-only hosts and the compiled kernels where CUDA exists."""
from __future__ import annotations

import importlib
import os
import sys
import warnings

import pytest
import torch

# Must happen before any @triton.jit in the process runs: the decorator picks interpreter or compiler.
# A GPU host keeps whatever the caller chose, so there the real compiled kernels are tested.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting else "cpu")


def _triton_built_compiled() -> bool:
    """True if triton itself was imported before TRITON_INTERPRET was set (its tl.* helpers then can't run)."""
    lang = sys.modules.get("triton.language")
    return lang is not None and type(lang.zeros).__name__ != "InterpretedFunction"


@pytest.fixture(scope="session")
def tk(device: torch.device):
    """inflight.attention.triton_kernels, with kernels built in the mode this host needs."""
    name = "inflight.attention.triton_kernels"
    if device.type == "cuda":
        return importlib.import_module(name)
    stale_triton = _triton_built_compiled()
    if stale_triton:
        # Another test imported triton before this conftest ran (only a root conftest can prevent that):
        # re-import triton's Python modules (its C extension stays) so they are rebuilt for the interpreter.
        warnings.warn("triton was imported before TRITON_INTERPRET=1 was set; re-importing it for the "
                      "kernel tests. Set TRITON_INTERPRET=1 in tests/conftest.py on CUDA-less hosts instead.",
                      stacklevel=2)
        for mod_name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            if not mod_name.startswith("triton._C"):
                del sys.modules[mod_name]
    was_imported = name in sys.modules
    mod = importlib.import_module(name)
    if was_imported and (stale_triton or not mod.INTERPRETED):
        # Redefine the kernels in place: the dispatcher holds this module object, so it sees them too.
        mod = importlib.reload(mod)
    assert mod.INTERPRETED
    return mod
