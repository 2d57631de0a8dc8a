"""Build Triton kernels to sm_90 (Hopper) machine code on a host without a GPU.

The CPU kernel tests run the Triton interpreter, which accepts code the real compiler rejects. So a CPU-only
CI also compiles the kernels, in a child process without the interpreter, down to SASS with triton's bundled
ptxas (no GPU or driver needed).

Parent side (pytest): run_compile_script(). Child side: capture_launches() records what the Python wrappers
launch and compile_for_sm90() compiles exactly that, as JITFunction.run would on an sm_90 device.
"""
from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BACKEND_SRC = os.path.normpath(os.path.join(HERE, "..", "..", "backend_src"))
SM90 = ("cuda", 90, 32)  # GPUTarget(backend, arch, warp_size)


def run_compile_script(code: str, device, timeout: float = 300) -> str:
    """Run `code` in a fresh python with TRITON_INTERPRET=0 and backend_src and this folder importable.

    Skips on a CUDA host (the other kernel tests compile and run the kernels there) and where triton's ptxas
    cannot be run; fails with the child's stderr unless it exits 0 and prints "compiled". Returns its stdout.
    """
    if device.type == "cuda":
        pytest.skip("the GPU compiles and runs these kernels in the other kernel tests")
    from triton import knobs  # the interpreter mode this process chose does not matter here
    try:
        knobs.nvidia.ptxas  # noqa: B018 -- resolving it runs `ptxas --version`
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"triton's ptxas cannot be run here ({exc}); set TRITON_PTXAS_PATH to a CUDA 12.x ptxas")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join((BACKEND_SRC, HERE))}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout


# ---- child side: only imported in the process run_compile_script starts -------------------------------


class _Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the call, launches nothing."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextlib.contextmanager
def capture_launches(module, names: tuple[str, ...]) -> Iterator[list[tuple[Any, tuple, dict]]]:
    """While open, the kernels `names` of `module` only record their launches, as (kernel, args, kwargs).

    On exit the kernels are restored, and each must have been launched at least once.
    """
    launches: list = []
    kernels = {name: getattr(module, name) for name in names}
    for name, kernel in kernels.items():
        setattr(module, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)
    missing = set(names) - {kernel.__name__ for kernel, _, _ in launches}
    assert not missing, f"never launched: {sorted(missing)}"


# Shared memory one block may use on sm_90 (H100, H200): 227 KiB. A variant needing more fails at launch.
SM90_MAX_SHARED = 232448


def compile_for_sm90(launches, stats: list[dict] | None = None) -> list[str]:
    """Compile every distinct launch to sm_90 machine code; return one line per compiled variant.

    Signature, constexprs and specialisation (ints equal to 1 folded, 16-divisibility hints) come from
    triton's own binder, as in JITFunction.run (triton 3.6, pinned in requirements.txt); only the target
    is fixed instead of read from a device. `stats`, when given, receives per variant its kernel, dtypes,
    named constexprs, shared memory bytes, num_warps, num_stages and compile seconds (wall and CPU). The
    compiled kernels land in triton's cache, under the key a run on an sm_90 device computes.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*SM90)
    backend = make_backend(target)
    done, lines = set(), []
    for kernel, args, kwargs in launches:
        kwargs = {**kwargs, "debug": kernel.debug or knobs.runtime.debug,
                  "instrumentation_mode": knobs.compilation.instrumentation_mode}
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = (kernel.__name__, str(signature), str(constexprs), str(attrs), str(options))
        if key in done:
            continue
        done.add(key)
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin"
        named = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
                 if kernel.arg_names[path[0]].isupper()}
        dtypes = sorted({t for t in signature.values() if t.startswith("*")})
        shared = compiled.metadata.shared
        lines.append(f"{kernel.__name__} {','.join(dtypes)} {named} shared={shared}")
        if stats is not None:
            stats.append({"kernel": kernel.__name__, "dtypes": dtypes, "constexprs": named, "shared": shared,
                          "num_warps": compiled.metadata.num_warps, "num_stages": compiled.metadata.num_stages,
                          "seconds": seconds, "cpu_seconds": cpu})
    return lines


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): unlike wall time, not inflated by a busy
    machine."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime
