"""A tritonserver's python-backend stubs, watched from outside: which are alive, which died and how.

Triton 2.51's python backend never looks at a stub between messages (no waitpid, no readiness hook, no
restart for decoupled models), so a stub killed between requests (the OOM killer, a native fault) stays a
zombie child of the server while the model still answers "ready". Its death is visible only in /proc: the
stub is in state Z, and /proc/<pid>/stat's last field holds its wait status (which signal killed it). A
zombie has an empty cmdline, so a stub must have been seen alive once to be recognised dead: StubWatch
remembers every stub it has seen. Standard library only (scripts/serve.py and the container probes use it).
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from .process import STUB_ARG_PARENT, STUB_NAME, python_stubs

STUB_ARG_INSTANCE = 8  # argv[8] of a 2.51 stub: the model instance name ("llm_0_1")


@dataclass(frozen=True)
class Stub:
    pid: int
    model: str  # the model's folder name: model.py lives at <repository>/<model>/<version>/model.py
    instance: str  # Triton's instance name, e.g. llm_0_1 (the `instance` label of our metrics)


@dataclass(frozen=True)
class DeadStub:
    stub: Stub
    cause: str  # "killed by signal 9 (SIGKILL)", "exited with status 1"


def server_stubs(server_pid: int) -> dict[int, Stub]:
    """The live stubs whose parent is this server, by pid."""
    stubs = {}
    for pid, argv in python_stubs():
        if len(argv) > STUB_ARG_PARENT and argv[STUB_ARG_PARENT] == str(server_pid):
            model = Path(argv[1]).parent.parent.name if len(argv) > 1 else "?"
            instance = argv[STUB_ARG_INSTANCE] if len(argv) > STUB_ARG_INSTANCE else "?"
            stubs[pid] = Stub(pid, model, instance)
    return stubs


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None once the pid is reaped."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def describe_wait_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {number} ({name})"
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def death_of(pid: int) -> str | None:
    """None while the process lives; else why it ended (its wait status, read while it is a zombie)."""
    fields = _stat_fields(pid)
    if fields is None:
        return "gone (reaped by its server)"
    if fields[0] not in ("Z", "X"):
        return None
    try:
        return describe_wait_status(int(fields[-1]))
    except ValueError:
        return "a zombie"


class StubWatch:
    """Stubs of one server, remembered from the first poll that saw them alive.

    A remembered stub that is now a zombie is dead. One that is gone altogether was reaped by Triton itself,
    which happens only when it unloads the instance (or stops): that is not a death, and it is forgotten.
    """

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.known: dict[int, Stub] = {}

    def poll(self) -> list[DeadStub]:
        self.known.update(server_stubs(self.server_pid))
        dead = []
        for pid, stub in list(self.known.items()):
            cause = death_of(pid)
            if cause is None:
                continue
            if cause.startswith("gone"):
                del self.known[pid]
            else:
                dead.append(DeadStub(stub, cause))
        return dead


def zombie_stubs(server_pid: int) -> list[str]:
    """Dead stubs of this server found without memory (a probe runs once): its zombie children whose name is the
    stub's (a zombie keeps its comm, "triton_python_b", but loses its cmdline). Each as "pid N: <cause>"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None or fields[0] != "Z" or fields[1] != str(server_pid):
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if STUB_NAME.startswith(comm):
            found.append(f"pid {entry.name}: {death_of(int(entry.name))}")
    return found
