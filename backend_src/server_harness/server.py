"""Start the real tritonserver (for a test or a benchmark), stop it by its own pid, and report what it left behind.

Used through the `triton_server_factory` fixture (tests/conftest.py) or directly:

    with TritonServer(repo_dir, log_path=tmp_path / "server.log") as server:
        client = tritonclient.http.InferenceServerClient(server.http_url)
        ...
    assert server.leftovers() == []
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, Mapping

# Shared with scripts/serve.py (`make serve`): the readiness wait, and finding a server's stubs and shm regions.
from .process import (SHM_DIR, SHM_PREFIX, STUB_ARG_PARENT, STUB_ARG_SHM, TRITONSERVER, python_stubs, shm_regions,
                      wait_ready)

__all__ = ["SHM_DIR", "STUB_ARG_PARENT", "STUB_ARG_SHM", "TRITONSERVER", "TritonServer", "free_ports", "python_stubs",
           "shm_regions"]


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out for port 0, all held at once so they are distinct."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def shm_mappers() -> dict[str, set[int]]:
    """Region name -> pids that have it mapped (a server maps every region of its stubs)."""
    users: dict[str, set[int]] = {}
    marker = str(SHM_DIR / SHM_PREFIX)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            maps = (entry / "maps").read_text(errors="replace")
        except OSError:
            continue
        for line in maps.splitlines():
            at = line.find(marker)
            if at >= 0:
                name = line[at + len(str(SHM_DIR)) + 1:].split()[0]
                users.setdefault(name, set()).add(int(entry.name))
    return users


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the test process dies without stopping us,
    so a killed pytest does not leave a server holding ports. (Tied to the forking thread:
    start servers from the main thread or a long-lived one.)"""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LoopbackEndpoints:
    """The addresses of a server whose HTTP, gRPC and metrics ports (http_port, grpc_port, metrics_port) are on
    127.0.0.1: a tritonserver of ours, or a container's published ports."""

    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class TritonServer(LoopbackEndpoints):
    """One tritonserver process on free loopback ports.

    http_url / grpc_url are "127.0.0.1:PORT", the form tritonclient takes; http_base is the
    same with "http://" for raw requests; metrics_url is the full Prometheus scrape address.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        extra_args: Iterable[str] = (),
        *,
        log_path: str | os.PathLike | None = None,
        model_control_mode: str | None = None,
        exit_timeout_s: int = 10,
        startup_timeout_s: float = 180.0,
        stop_timeout_s: float | None = None,
        leftover_settle_s: float = 5.0,
        env: Mapping[str, str] | None = None,
        clear_env: bool = False,
        binary: str | os.PathLike = TRITONSERVER,
    ) -> None:
        self.model_repository = Path(model_repository)
        self.extra_args = list(extra_args)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.model_control_mode = model_control_mode
        self.exit_timeout_s = exit_timeout_s
        self.startup_timeout_s = startup_timeout_s
        # Triton itself waits up to --exit-timeout-secs for in-flight work; give it that
        # plus time to unload models before escalating to SIGKILL.
        self.stop_timeout_s = stop_timeout_s if stop_timeout_s is not None else exit_timeout_s + 30
        # Orphaned stubs notice a dead parent by themselves within seconds; wait this long
        # for them before reporting them as left behind.
        self.leftover_settle_s = leftover_settle_s
        self.env = dict(env or {})
        self.clear_env = clear_env  # True: `env` is the whole environment, not additions to ours
        self.binary = Path(binary)
        self.proc: subprocess.Popen | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0
        self._shm_before: set[str] = set()
        self._our_shm: set[str] = set()
        self._problems: list[str] = []
        self._problems_checked = False

    # -- addresses ---------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("server not started")
        return self.proc.pid

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- start -------------------------------------------------------------------------------
    def start(self) -> "TritonServer":
        if self.proc is not None:
            raise RuntimeError("already started")
        if not self.binary.exists():
            raise RuntimeError(f"{self.binary} is missing: run `make setup` first")
        self._shm_before = shm_regions()
        # Free ports can be taken by someone else before Triton binds them, and Triton only
        # notices after loading its models; then it exits, and a fresh set of ports is tried.
        for attempt in range(3):
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._launch()
            if self._wait_ready():
                # Remember our regions now: after a crash they can only be guessed.
                self._remember_our_shm()
                return self
            if "already in use" not in self.log_text()[log_offset:] or attempt == 2:
                break
            # Triton exits on a port clash with its stubs still alive; clean those up before
            # the next try (a port race is not the test's fault, so it is not reported).
            self.proc.wait()
            self._check_leftovers()
            with open(self.log_path, "a") as log:
                log.write(f"# harness: port clash, retrying; cleaned up: {self._problems}\n")
            self._problems, self._problems_checked = [], False
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(
            f"tritonserver did not become ready (exit code {self.proc.returncode}, "
            f"log {self.log_path}):\n{tail}"
        )

    def _launch(self) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        args = [
            str(self.binary),
            f"--model-repository={self.model_repository}",
            "--http-address=127.0.0.1", f"--http-port={self.http_port}",
            "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
            "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        if self.model_control_mode:
            args.append(f"--model-control-mode={self.model_control_mode}")
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(args)}\n".encode())
            log.flush()
            # The wrapper execs the real binary, so this pid is tritonserver's own.
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env if self.clear_env else {**os.environ, **self.env}, cwd=self.log_path.parent,
                preexec_fn=_die_with_parent,
            )

    def _wait_ready(self) -> bool:
        """True once /v2/health/ready answers 200; False as soon as the process exits."""
        return wait_ready(self.proc, f"{self.http_base}/v2/health/ready", self.startup_timeout_s, poll_s=0.1)

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """SIGTERM our own pid, SIGKILL after stop_timeout_s, then look for leftovers.

        Problems are recorded for leftovers() and then cleaned up (our orphan stubs killed,
        our shm regions removed) so one broken test does not spill into the next.
        """
        if self.proc is None or self._problems_checked:
            return
        if self.proc.poll() is None:
            self._remember_our_shm()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._problems.append(
                    f"tritonserver pid {self.pid} ignored SIGTERM for {self.stop_timeout_s} s; "
                    "sent SIGKILL")
                self.proc.kill()
                self.proc.wait()
        self._check_leftovers()

    def _remember_our_shm(self) -> None:
        self._our_shm |= {argv[STUB_ARG_SHM] for _, argv in self._our_stubs()}
        self._our_shm |= {name for name, pids in shm_mappers().items() if self.pid in pids}

    def _our_stubs(self) -> list[tuple[int, list[str]]]:
        me = str(self.pid)
        return [(pid, argv) for pid, argv in python_stubs()
                if len(argv) > STUB_ARG_PARENT and argv[STUB_ARG_PARENT] == me]

    def _check_leftovers(self) -> None:
        self._problems_checked = True
        deadline = time.monotonic() + self.leftover_settle_s
        while self._our_stubs() and time.monotonic() < deadline:
            time.sleep(0.1)
        stubs = self._our_stubs()
        for pid, argv in stubs:
            self._problems.append(f"python backend stub pid {pid} ({argv[1]}) outlived the server")
            self._our_shm.add(argv[STUB_ARG_SHM])
        # A region that appeared while we ran is ours unless another live process (a server
        # started beside ours, or its stub) uses it; tests of several people share /dev/shm.
        ours = {pid for pid, _ in stubs}
        others = {argv[STUB_ARG_SHM] for pid, argv in python_stubs()
                  if len(argv) > STUB_ARG_SHM and pid not in ours}
        others |= {name for name, pids in shm_mappers().items() if pids - ours}
        new_shm = sorted(shm_regions() - self._shm_before - others)
        for name in new_shm:
            self._problems.append(f"shared memory {SHM_DIR / name} left behind")
        # Clean up only what is certainly ours.
        for pid, _ in stubs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in new_shm:
            if name in self._our_shm:
                (SHM_DIR / name).unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """Problems found by stop(): surviving stubs, shm regions, a needed SIGKILL."""
        if self.proc is None:
            return []
        if not self._problems_checked:
            raise RuntimeError("call stop() first")
        return list(self._problems)

    def __enter__(self) -> "TritonServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
