"""perf.probes.stream_cpu's /proc accounting: a child that burns CPU shows up, under its own name, with about
the time it burned; one that sleeps does not."""
import subprocess
import sys
import time

from perf.probes import stream_cpu

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\ntime.sleep(30)\n"


def _wait_cpu(pid: int, at_least_ns: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(stream_cpu.thread_run_ns(pid).values()) < at_least_ns:
        assert time.monotonic() < deadline, "the child never burned its CPU"
        time.sleep(0.05)


def test_burning_child_is_counted_and_sleeping_one_is_not():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    burner = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.4)])
    try:
        time.sleep(0.3)  # both started; the burner is mid-loop
        before = stream_cpu.snapshot(stream_cpu.os.getpid())
        _wait_cpu(burner.pid, int(0.4e9))  # its loop is done
        after = stream_cpu.snapshot(stream_cpu.os.getpid())
        assert {k.pid for k in after} >= {sleeper.pid, burner.pid}
        figures = stream_cpu.per_token(before, after, tokens=1)
        by_pid = {t["tid"]: t["ms"] for t in figures["busiest_threads_ms_per_token"]}
        assert by_pid.get(burner.pid, 0) > 50  # its main thread ran most of the 0.4 s inside the window
        assert by_pid.get(sleeper.pid, 0) < 20
        role = stream_cpu.process_role(burner.pid)
        assert role.startswith("python"), role
        assert figures["processes_ms_per_token"][role] >= by_pid[burner.pid]
    finally:
        for p in (sleeper, burner):
            p.kill()
            p.wait()


def test_descendants_follow_grandchildren():
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time\n"
                              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
                              "print(g.pid, flush=True)\ntime.sleep(30)\n"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert {child.pid, grandchild} <= set(stream_cpu.descendants(stream_cpu.os.getpid()))
        assert grandchild not in stream_cpu.descendants(grandchild)
    finally:
        subprocess.run(["kill", str(grandchild)])
        child.kill()
        child.wait()
