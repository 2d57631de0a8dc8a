"""server_harness.stub_watch reads a stub's death from /proc while Triton 2.51 has not reaped it: a child killed
with SIGKILL stays a zombie of its parent, with its wait status in /proc/<pid>/stat. Here the parent is this
test process and the "stub" a child named like the real one."""
from __future__ import annotations

import os
import signal
import time

import pytest

from server_harness.stub_watch import StubWatch, death_of, describe_wait_status, zombie_stubs


def fake_stub(name: bytes = b"triton_python_backend_stub") -> int:
    """A child that renames itself like a stub (comm is what a zombie keeps) and waits to be killed."""
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes
            import faulthandler
            faulthandler.disable()  # pytest's would print a traceback for the signals sent on purpose
            ctypes.CDLL(None).prctl(15, name[:15], 0, 0, 0)  # PR_SET_NAME
            time.sleep(60)
        finally:
            os._exit(0)
    return pid


def test_wait_statuses_are_named():
    assert describe_wait_status(9) == "killed by signal 9 (SIGKILL)"
    assert describe_wait_status(11) == "killed by signal 11 (SIGSEGV)"
    assert describe_wait_status(3 << 8) == "exited with status 3"


def test_a_killed_child_is_a_zombie_with_its_signal_until_reaped():
    pid = fake_stub()
    try:
        time.sleep(0.2)
        assert death_of(pid) is None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while death_of(pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert death_of(pid) == "killed by signal 9 (SIGKILL)"
        assert zombie_stubs(os.getpid()) == [f"pid {pid}: killed by signal 9 (SIGKILL)"]
    finally:
        os.waitpid(pid, 0)
    assert death_of(pid) == "gone (reaped by its server)"
    assert zombie_stubs(os.getpid()) == []


def test_a_zombie_that_is_not_a_stub_is_not_reported():
    pid = fake_stub(b"something_else")
    try:
        time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        assert zombie_stubs(os.getpid()) == []
    finally:
        os.waitpid(pid, 0)


def test_stub_watch_forgets_stubs_its_server_reaped(monkeypatch):
    """A stub seen once and later reaped by Triton (an unload) is no death; a zombie is."""
    pid = fake_stub()
    from server_harness import stub_watch
    from server_harness.stub_watch import Stub
    monkeypatch.setattr(stub_watch, "server_stubs", lambda server_pid: {pid: Stub(pid, "llm", "llm_0_0")}
                        if death_of(pid) is None else {})
    watch = StubWatch(os.getpid())
    try:
        assert watch.poll() == [] and pid in watch.known
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)
        (dead,) = watch.poll()
        assert dead.stub.instance == "llm_0_0" and dead.cause == "killed by signal 9 (SIGKILL)"
    finally:
        os.waitpid(pid, 0)
    assert watch.poll() == [] and pid not in watch.known


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_native_faults_are_named(sig):
    pid = fake_stub()
    try:
        time.sleep(0.2)
        os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while death_of(pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert death_of(pid) == f"killed by signal {int(sig)} ({sig.name})"
    finally:
        os.waitpid(pid, 0)
