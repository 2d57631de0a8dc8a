"""Facts about this host that benchmarks record beside their figures (the machines here change between sessions).
Imports nothing of ours: importing inflight would set its OpenMP defaults in this process's environment, which
servers started from it (llama.cpp's among them) would inherit."""
from __future__ import annotations


def cpuinfo_field(key: str) -> str:
    """The first value of `key` in /proc/cpuinfo ("model name", "vendor_id", ...), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model_name() -> str:
    """The CPU's model name, or "unknown"."""
    return cpuinfo_field("model name") or "unknown"


def rss_mb(pid: int | None) -> float | None:
    """A process's resident memory (VmRSS) in MB, or None when it is gone (or pid is None)."""
    return status_mb(pid, "VmRSS")


def status_mb(pid: int | None, field: str, table: str = "status") -> float | None:
    """A memory field of /proc/<pid>/<table> (status: VmRSS, RssAnon, ...; smaps_rollup: Pss, ...) in MB, or None
    when the process is gone."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/{table}") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
