"""The memory of one side of a comparison: every process under its root (tritonserver and all its python-backend
stubs; llama-server), summed, from /proc.

RSS counts a page shared by two processes of a side twice (tritonserver maps every stub's shared-memory region);
PSS (/proc/<pid>/smaps_rollup) splits each shared page among the processes that map it, so the PSS sum is what the
side as a whole holds. Both are reported; PSS is None where smaps_rollup cannot be read.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from server_harness.host import status_mb
from server_harness.process import STUB_NAME
from server_harness.stub_watch import STUB_ARG_INSTANCE


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    name: str
    rss_mb: float
    pss_mb: float | None


def descendants(root: int, parent_of: Mapping[int, int]) -> list[int]:
    """root and every process below it (children, their children, ...), root first, then by pid."""
    children: dict[int, list[int]] = {}
    for pid, parent in parent_of.items():
        children.setdefault(parent, []).append(pid)
    found, frontier = [root], [root]
    while frontier:
        below = sorted(c for p in frontier for c in children.get(p, []) if c != p)
        found += below
        frontier = below
    return found


def side_memory(processes: list[ProcessMemory]) -> dict:
    """The side's totals (MB) and each process counted in them. pss_mb is None when any process lacked it, so a
    partial sum never passes for the whole."""
    pss = [p.pss_mb for p in processes]
    return {"rss_mb": round(sum(p.rss_mb for p in processes), 1),
            "pss_mb": None if not processes or None in pss else round(sum(pss), 1),
            "processes": [{"pid": p.pid, "name": p.name, "rss_mb": round(p.rss_mb, 1),
                           "pss_mb": None if p.pss_mb is None else round(p.pss_mb, 1)} for p in processes]}


def parent_table() -> dict[int, int]:
    """pid -> parent pid of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # The command name in parentheses may hold spaces and ')': the fields after the last ')' are fixed.
        table[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return table


def _name(pid: int) -> str:
    """The program's name; a python-backend stub by its Triton instance name (llm_0_0)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    program = os.path.basename(argv[0])
    if program == STUB_NAME and len(argv) > STUB_ARG_INSTANCE:
        return f"stub {argv[STUB_ARG_INSTANCE]}"
    return program


def read_process(pid: int) -> ProcessMemory | None:
    rss = status_mb(pid, "VmRSS")
    if rss is None:  # gone, or a kernel thread
        return None
    return ProcessMemory(pid, _name(pid), rss, status_mb(pid, "Pss", "smaps_rollup"))


def measure_side(root: int) -> dict:
    """side_memory of root and everything below it, now."""
    found = (read_process(pid) for pid in descendants(root, parent_table()))
    return side_memory([p for p in found if p is not None])
