"""The engine switches as they apply on this host: "auto" settings resolved per CPU (vendor, torch's build) and
device, in one place, and said once in the log at load.

Why per CPU: MKL's few-row products are fast on Intel CPUs and slow elsewhere (AMD: 1.5-2.5x oneDNN's time at
one to three rows), so on Intel Linear takes BLAS for up to 3 rows, elsewhere the native decode step's own
product serves up to 4 (docs/cpu.md, perf/probes/gemv_rows.py). oneDNN's linear is the default where torch's build
has it.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

from .config import EngineConfig

log = logging.getLogger(__name__)

GEMV_ROWS_BLAS = 3  # Intel: MKL's sgemv/sgemm on the dense weight, measured on a Xeon
GEMV_ROWS_NATIVE = 4  # elsewhere: decode_step.c's product, measured on an EPYC Zen 3 (docs/cpu.md)


@dataclass(frozen=True)
class ResolvedSwitches:
    """What the model runner passes down: no "auto" left. `why` says, per switch, where its value came from."""
    cpu_gemm: str  # onednn | blas
    cpu_gemv_rows: int
    few_row_blas: bool  # Linear takes BLAS on the dense weight at up to cpu_gemv_rows rows (Intel)
    cpu_native_decode: bool
    cpu_compile: bool
    cpu_thread_governor: bool
    fused_ops: bool
    attention_backend: str  # triton | torch
    why: dict[str, str]

    def summary(self, device_type: str) -> str:
        names = (["cpu_gemm", "cpu_gemv_rows", "cpu_native_decode", "cpu_compile", "cpu_thread_governor"]
                 if device_type == "cpu" else []) + ["fused_ops", "attention_backend"]
        return ", ".join(f"{n}={_show(getattr(self, n))} ({self.why[n]})" for n in names)


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo (GenuineIntel, AuthenticAMD, ...), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def has_cxx_compiler() -> bool:
    """Whether inductor's C++ compiler ($CXX, else g++) is on PATH."""
    return shutil.which(os.environ.get("CXX") or "g++") is not None


def resolve_cpu_defaults(config: EngineConfig, vendor: str | None = None,
                         onednn: bool | None = None) -> ResolvedSwitches:
    """Every switch of `config` as it applies here. vendor and onednn (whether torch's oneDNN linear works) are
    read from the host unless given (tests)."""
    from .onednn import onednn_available  # it imports torch; this module stays light
    vendor = cpu_vendor() if vendor is None else vendor
    onednn = onednn_available() if onednn is None else onednn
    is_cuda = str(config.device).startswith("cuda")
    why = {}
    few_row_blas = vendor == "GenuineIntel"

    if config.cpu_gemm == "blas":
        gemm, why["cpu_gemm"] = "blas", "set"
    elif onednn:
        gemm, why["cpu_gemm"] = "onednn", "set" if config.cpu_gemm == "onednn" else "auto: torch has oneDNN"
    else:
        gemm, why["cpu_gemm"] = "blas", f"{config.cpu_gemm}: this torch build has no oneDNN linear"

    label = vendor or "unknown vendor"
    if config.cpu_gemv_rows == "auto":
        rows = GEMV_ROWS_BLAS if few_row_blas else GEMV_ROWS_NATIVE
        how = "MKL's BLAS" if few_row_blas else "the native step's product, MKL is slow here"
        why["cpu_gemv_rows"] = f"auto: {label}, {how}"
    else:
        rows = config.cpu_gemv_rows
        why["cpu_gemv_rows"] = f"set; {label}: {'BLAS' if few_row_blas else 'the native product'}"

    why["cpu_native_decode"] = "set" if not config.cpu_native_decode else "default"
    compile_ = config.cpu_compile
    why["cpu_compile"] = "set" if compile_ else "default: off"
    if compile_ and not is_cuda and not has_cxx_compiler():
        log.warning("no C++ compiler (%s) on PATH: the CPU forward stays eager (slower)",
                    os.environ.get("CXX") or "g++")
        compile_, why["cpu_compile"] = False, "set, but no C++ compiler"
    why["cpu_thread_governor"] = "default" if config.cpu_thread_governor else "set"

    fused = config.fused_ops == "1" or (config.fused_ops == "auto" and is_cuda)
    why["fused_ops"] = f"auto: {'CUDA' if is_cuda else 'not CUDA'}" if config.fused_ops == "auto" else "set"
    if config.attention_backend == "auto":
        backend, why["attention_backend"] = ("triton" if is_cuda else "torch"), f"auto: {config.device}"
    else:
        backend, why["attention_backend"] = config.attention_backend, "set"
    return ResolvedSwitches(cpu_gemm=gemm, cpu_gemv_rows=rows, few_row_blas=few_row_blas,
                            cpu_native_decode=config.cpu_native_decode, cpu_compile=compile_,
                            cpu_thread_governor=config.cpu_thread_governor, fused_ops=fused,
                            attention_backend=backend, why=why)
