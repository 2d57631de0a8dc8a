"""The batches Triton's dynamic batcher hands to llm_dynamic, run one static batch at a time on a worker thread,
so that execute() returns at once.

Why not run the batch inside execute(): the python backend's parent process waits for execute() with a health
check (it expects the stub's health thread to tick within each second). If the stub stops for a second or more
(SIGSTOP, a frozen container, a stall in memory reclaim), Triton 2.51 gives up on the batch: it sends every
request a final error, releases them, and later takes the stub's late answer to that execute for the answer to
the next one. The stub, still alive, goes on streaming for requests Triton has finished, and tritonserver dies
with SIGSEGV (docs/faults.md, `python -m perf.faults.cancel_loop --stall`). With execute() returning at once the
parent never waits on a batch, so a stall only delays tokens.

Batches keep the dynamic batcher's shape: while a static batch runs, Triton goes on forming batches (by
preferred size or max queue delay) and they wait here; when the engine is free, the next static batch takes the
waiting requests in arrival order the way the batcher takes its queue when an instance comes free: the largest
preferred batch size that they fill, else all of them, at most max_batch_size. Transport-agnostic, like the
runner; tested without a server.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

from serving.errors import CANCELLED, RequestError
from serving.lifecycle import send_error

from .static_batch import BatchItem, StaticBatchRunner

log = logging.getLogger(__name__)
UNLOADING = "cancelled: the model is being unloaded"  # as llm says it, for requests it had accepted


def next_batch_size(waiting: int, max_batch_size: int, preferred: Sequence[int]) -> int:
    """How many of the waiting requests the next static batch takes (Triton's rule for a free instance)."""
    if waiting >= max_batch_size:
        return max_batch_size
    filled = [p for p in preferred if p <= waiting]
    return max(filled) if filled else waiting


class BatchLine:
    def __init__(self, runner: StaticBatchRunner, max_batch_size: int, preferred: Sequence[int] = (),
                 on_batch: Callable[[int], None] | None = None):
        self.runner = runner
        self.max_batch_size = max(1, max_batch_size)
        self.preferred = sorted(p for p in preferred if 0 < p <= self.max_batch_size)
        self.on_batch = on_batch  # called with its size as each static batch starts (for /metrics)
        self._waiting: deque[tuple[int, BatchItem]] = deque()  # (Triton batch number, item)
        self._batches = 0
        # The latest static batches run, (Triton batches joined, size): bounded, since the line runs for days.
        self.ran: deque[tuple[int, int]] = deque(maxlen=64)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="llm_dynamic-batches", daemon=True)
        self._thread.start()

    def submit(self, items: list[BatchItem]) -> None:
        """One batch from execute(); returns at once. After close(), the items get a CANCELLED final."""
        if not items:
            return
        with self._cond:
            if not self._closed:
                self._batches += 1
                self._waiting.extend((self._batches, item) for item in items)
                self._cond.notify()
                return
        self._refuse(items)

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def close(self, timeout_s: float = 30.0) -> None:
        """No new batches; the waiting ones get a CANCELLED final; the running one ends as the runner decides
        (it watches for the unload itself). Returns once the worker has stopped, or after timeout_s."""
        with self._cond:
            self._closed = True
            left = [item for _, item in self._waiting]
            self._waiting.clear()
            self._cond.notify_all()
        self._refuse(left)
        self._thread.join(timeout_s)

    def _take(self) -> list[tuple[int, BatchItem]] | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            n = next_batch_size(len(self._waiting), self.max_batch_size, self.preferred)
            return [self._waiting.popleft() for _ in range(n)]

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            items = [item for _, item in taken]
            if self.on_batch is not None:
                try:
                    self.on_batch(len(items))
                except Exception:  # noqa: BLE001 - reporting must never stop the line
                    log.exception("reporting a batch failed")
            try:
                stats = self.runner.run(items)  # every item gets its final inside, on every path
            except Exception:  # noqa: BLE001 - the runner already ended every request; the line goes on
                log.exception("static batch failed")
                continue
            joined = len({n for n, _ in taken})
            log.info("batch of %d requests from %d Triton batch(es) (%d admitted): %d steps in %.2f s (engine %.2f s, "
                     "sending %.2f s, cancel checks %.2f s; %d ensemble cancels relayed)", stats.batch_size, joined,
                     stats.num_admitted, stats.num_steps, stats.seconds, stats.step_s, stats.send_s, stats.poll_s,
                     stats.relayed_cancels)
            self.ran.append((joined, stats.batch_size))
            if self.runner.unload_watch.unloading:  # the model is going: nothing more starts
                with self._cond:
                    self._closed = True
                    left = [item for _, item in self._waiting]
                    self._waiting.clear()
                self._refuse(left)

    def _refuse(self, items: list[BatchItem]) -> None:
        for item in items:
            send_error(self.runner.responder.transport, item.sender, RequestError(UNLOADING, CANCELLED),
                       item.client_id)
