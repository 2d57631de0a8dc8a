"""What `make serve` (scripts/serve.py) and the harness (server.py) share about a tritonserver process
they started: where the binary is, waiting until it is ready, and finding its python-backend stubs and
their /dev/shm regions.

Stubs are found in /proc by name, and a stub's argv names its shm region and its server's pid.
Standard library only.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# The wrapper scripts/setup.sh writes into the venv (library paths, backend directory): the venv that runs
# this code is the one whose tritonserver we start.
TRITONSERVER = Path(sys.prefix) / "bin" / "tritonserver"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
STUB_NAME = "triton_python_backend_stub"
# argv of a stub: [stub, model.py, shm region name, shm size, shm growth, server pid, ...]
STUB_ARG_SHM = 2
STUB_ARG_PARENT = 5


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.2) -> bool:
    """True once url (a health endpoint) answers 200; False as soon as proc exits, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(poll_s)
    return False


def python_stubs() -> list[tuple[int, list[str]]]:
    """(pid, argv) of every live python backend stub on the machine, from /proc."""
    stubs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if argv and os.path.basename(argv[0]).decode(errors="replace") == STUB_NAME:
            stubs.append((int(entry.name), [a.decode(errors="replace") for a in argv]))
    return stubs


def shm_regions() -> set[str]:
    return {p.name for p in SHM_DIR.glob(SHM_PREFIX + "*")}
