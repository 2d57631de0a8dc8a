"""Grammar compiles in two worker processes, so that no request's grammar can hold back everyone else's.

A compile cannot be stopped inside a thread, and one costly schema (seconds per bounded string, grammar/cost.py)
used to hold the only compile thread while every other new grammar waited and timed out behind it. Here each
compile runs in a child process (grammar/compile_worker.py) that is killed when the compile runs past its deadline,
which gives its core back at once. Two lanes: the light lane takes only specs told cheap before compiling (and
kills one that is not, after LIGHT_LIMIT_S, handing it to the heavy lane), the heavy lane takes the costly ones
first and helps with cheap ones when it has none. So costly compiles, whoever sends them, hold one process at most,
and a cheap grammar waits for other cheap ones only.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .spec import GrammarSpec

log = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")
LIGHT_LIMIT_S = 0.5  # a "cheap" compile running longer was mis-told: it moves to the heavy lane
START_TIMEOUT_S = 60.0
# A process that grew past this is replaced after its job: a costly compile's peak stays in its heap (two plateaued
# strings left one at 736 MB of private memory), and 0.4 s to start a new one is cheaper than keeping that.
RECYCLE_RSS_MB = 256

GRAMMAR, ERROR, TIMED_OUT, EXPIRED, CLOSED = "grammar", "error", "timed_out", "expired", "closed"


@dataclass
class CompileJob:
    """One spec to compile for the requests waiting on `future`; `deadline` is the first one's (monotonic)."""
    spec: GrammarSpec
    request: bytes  # the worker's job frame
    future: concurrent.futures.Future
    deadline: float
    light: bool


@dataclass
class Outcome:
    """How a job ended: GRAMMAR (payload: xgrammar's JSON), ERROR (payload: the library's reason), TIMED_OUT (killed
    at its deadline), EXPIRED (its deadline passed before a worker took it: not the spec's fault) or CLOSED."""
    kind: str
    payload: bytes = b""
    seconds: float = 0.0


def python_executable() -> str:
    """This interpreter, also inside Triton's stub, whose sys.executable may be the stub binary itself."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else (shutil.which("python3") or "python3")


class CompileProcess:
    """One compile_worker.py child: started with the vocabulary, then fed one job at a time."""

    def __init__(self, name: str, tokenizer_info: bytes):
        self.name = name
        self._tokenizer_info = tokenizer_info
        self.proc: subprocess.Popen | None = None
        self.is_ready = False  # it has read the vocabulary and waits for jobs

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the same packages as ours
        self.proc = subprocess.Popen([python_executable(), str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, close_fds=True)
        self._send(self._tokenizer_info)
        if self._receive(time.monotonic() + START_TIMEOUT_S) != b"ready":
            raise RuntimeError(f"grammar compile process {self.name} did not start")
        self.is_ready = True
        log.info("grammar compile process %s started (pid %d, %s)", self.name, self.proc.pid, python_executable())

    def compile(self, request: bytes, deadline: float) -> bytes | None:
        """The worker's reply, or None when `deadline` passed first (the process is then killed)."""
        self._send(request)
        reply = self._receive(deadline)
        if reply is None:
            self.kill()
        return reply

    def kill(self) -> None:
        # Taken first: close() and the lane's own thread (a deadline) may kill the same process at once.
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float:
        try:
            resident_pages = int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1])
        except (OSError, AttributeError, IndexError, ValueError):
            return 0.0
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _send(self, data: bytes) -> None:
        self.proc.stdin.write(len(data).to_bytes(8, "big") + data)
        self.proc.stdin.flush()

    def _receive(self, deadline: float) -> bytes | None:
        head = self._read_exactly(8, deadline)
        return None if head is None else self._read_exactly(int.from_bytes(head, "big"), deadline)

    def _read_exactly(self, size: int, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, min(size - got, 1 << 20))
            if not chunk:
                raise RuntimeError(f"grammar compile process {self.name} died (exit {self.proc.wait()})")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)


class CompilePool:
    """The two lanes, each a thread driving its own process. on_outcome(job, outcome) is called from a lane's
    thread once per job; tokenizer_info() gives the vocabulary (xgrammar's TokenizerInfo JSON), read once."""

    def __init__(self, tokenizer_info: Callable[[], bytes], on_outcome: Callable[[CompileJob, Outcome], None],
                 light_limit_s: float = LIGHT_LIMIT_S):
        self._tokenizer_info = tokenizer_info
        self._on_outcome = on_outcome
        self.light_limit_s = light_limit_s
        self._cond = threading.Condition()
        self._queue: list[CompileJob] = []
        self._threads: list[threading.Thread] = []
        self._processes: dict[str, CompileProcess] = {}
        self._closed = False

    def submit(self, job: CompileJob) -> None:
        with self._cond:
            self._start_lanes()
            self._queue.append(job)
            self._cond.notify_all()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start both lanes' processes now and wait for them (they start with the first job otherwise)."""
        with self._cond:
            self._start_lanes()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (
                len(self._processes) == 2 and all(p.is_ready for p in list(self._processes.values()))):
            time.sleep(0.01)

    def _start_lanes(self) -> None:
        if self._closed:
            raise RuntimeError("the grammar compile pool is closed")
        if not self._threads:
            self._threads = [threading.Thread(target=self._serve, args=(lane,), name=f"grammar-{lane}", daemon=True)
                             for lane in ("light", "heavy")]
            for thread in self._threads:
                thread.start()

    def close(self) -> None:
        """Kill both processes; every job not yet done ends CLOSED."""
        with self._cond:
            self._closed = True
            left, self._queue = self._queue, []
            self._cond.notify_all()
        for process in list(self._processes.values()):
            process.kill()
        for job in left:
            self._on_outcome(job, Outcome(CLOSED))

    def pids(self) -> dict[str, int]:
        """The lanes' live process ids (tests, diagnostics)."""
        return {lane: p.proc.pid for lane, p in list(self._processes.items()) if p.is_alive}

    # ---- a lane's thread --------------------------------------------------------------------------------------
    def _next(self, lane: str) -> CompileJob | None:
        """The light lane: the oldest cheap job. The heavy lane: the oldest costly job, else the oldest cheap one."""
        with self._cond:
            while not self._closed:
                costly = [j for j in self._queue if not j.light]
                cheap = [j for j in self._queue if j.light]
                pick = (cheap[:1] if lane == "light" else (costly or cheap)[:1])
                if pick:
                    self._queue.remove(pick[0])
                    return pick[0]
                self._cond.wait()
            return None

    def _serve(self, lane: str) -> None:
        while True:
            try:
                self._process(lane)  # (re)started before the next job comes, not while it waits
            except Exception as e:  # noqa: BLE001 - tried again with the next job, whose outcome then says why
                if not self._closed:  # (close() kills a process that is starting: nothing to report then)
                    log.warning("grammar compile process %s could not start: %s", lane, e)
            job = self._next(lane)
            if job is None:
                return
            try:
                outcome = self._run(lane, job)
            except Exception as e:  # noqa: BLE001 - the process died or could not start: this job fails, not the lane
                self._kill(lane)
                if self._closed:  # close() killed the process under this job
                    outcome = Outcome(CLOSED)
                else:
                    log.warning("grammar compile in lane %s failed: %s", lane, e)
                    outcome = Outcome(ERROR, f"the compile process failed ({e})".encode())
            if outcome is not None:
                self._on_outcome(job, outcome)

    def _run(self, lane: str, job: CompileJob) -> Outcome | None:
        """Compile one job in this lane's process; None when it was handed to the heavy lane instead."""
        now = time.monotonic()
        if now >= job.deadline:
            return Outcome(EXPIRED)
        process = self._process(lane)
        limit = job.deadline if lane == "heavy" else min(job.deadline, time.monotonic() + self.light_limit_s)
        t0 = time.monotonic()
        reply = process.compile(job.request, limit)
        seconds = time.monotonic() - t0
        if reply is not None:
            if process.rss_mb() > RECYCLE_RSS_MB:
                log.info("grammar compile process %s holds %.0f MB after a compile: replaced", lane, process.rss_mb())
                self._kill(lane)
            return Outcome(GRAMMAR if reply[:1] == b"G" else ERROR, reply[1:], seconds)
        if time.monotonic() < job.deadline:  # mis-told as cheap: the heavy lane starts it again, with what is left
            log.info("grammar %s took over %.1f s in the light lane: moved to the heavy lane", job.spec.source,
                     self.light_limit_s)
            job.light = False
            with self._cond:
                self._queue.insert(0, job)
                self._cond.notify_all()
            return None
        return Outcome(TIMED_OUT, seconds=seconds)

    def _process(self, lane: str) -> CompileProcess:
        process = self._processes.get(lane)
        if process is None or not process.is_alive:
            process = CompileProcess(lane, self._tokenizer_info())
            with self._cond:
                if self._closed:
                    raise RuntimeError("the grammar compile pool is closed")
                self._processes[lane] = process
            process.start()
        return process

    def _kill(self, lane: str) -> None:
        process = self._processes.pop(lane, None)
        if process is not None:
            process.kill()
