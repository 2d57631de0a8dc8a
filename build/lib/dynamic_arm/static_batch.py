"""Run the requests Triton batched together as ONE static batch to completion, streaming as tokens come.

Called from execute() and returns only when every request of the batch has had its final response:
an execute that returned early would let the dynamic batcher dispatch the next requests at once, and
the batches would collapse to size one. Transport-agnostic (the Triton model supplies the transport),
so every path is testable without a server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from inflight.sequence import RequestOutput
from serving.contract import ParsedRequest
from serving.errors import INTERNAL, INVALID_ARG, RequestError
from serving.lifecycle import LiveRequest, RequestIds, Responder, Transport, UnloadWatch, by_request

log = logging.getLogger(__name__)


@dataclass
class BatchItem:
    sender: Any
    client_id: str  # Triton's request id; may be empty or repeat
    prompt_ids: list[int]
    req: ParsedRequest
    arrival_time: float | None = None  # time.monotonic() when the request reached the server (preprocessing)


@dataclass
class BatchStats:
    batch_size: int
    num_admitted: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    step_s: float = 0.0  # in engine.step()
    send_s: float = 0.0  # in transport.send() (IPC to the server, per response)
    poll_s: float = 0.0  # in transport.is_cancelled() (IPC to the server, per live request and step)


class StaticBatchRunner:
    """Owns nothing but the engine's use during run(); one run at a time (Triton's execute thread).

    is_serving: probed (at most every serving_check_period_s) during a batch, through lifecycle.UnloadWatch;
    once the model is no longer served the batch is cancelled, so shutdown need not wait for it.
    """

    def __init__(self, engine: LLMEngine, transport: Transport, is_serving: Callable[[], bool | None] | None = None,
                 serving_check_period_s: float = 1.0):
        if not engine.config.static_batching:
            raise ValueError("engine config static_batching=False is not allowed here: the dynamic-batcher arm "
                             "runs each batch as one static batch; set static_batching=True")
        self.engine = engine
        self.responder = Responder(transport, with_token_ids=True)
        self.unload_watch = UnloadWatch(is_serving, serving_check_period_s)
        self._ids = RequestIds()

    def run(self, items: list[BatchItem]) -> BatchStats:
        t0 = time.monotonic()
        stats = BatchStats(batch_size=len(items))
        self.engine.metrics.on_batch(len(items))
        live: dict[str, LiveRequest] = {}
        for item in items:
            entry = LiveRequest(self._ids.new(item.client_id), item.client_id, item.sender, item.req)
            try:
                seq = self.engine.make_sequence(entry.internal_id, item.prompt_ids, item.req.params,
                                                item.req.priority, item.arrival_time)
                self.engine.add_sequence(seq)
            except InvalidRequestError as e:  # this request only; the rest of the batch proceeds
                self.responder.fail(entry, RequestError(str(e), INVALID_ARG))
                continue
            live[entry.internal_id] = entry
        stats.num_admitted = len(live)
        try:
            while self.engine.has_unfinished_requests():
                t = time.monotonic()
                outs = self._poll_cancellations(live)
                stats.poll_s += time.monotonic() - t
                if self.unload_watch.check():
                    outs += self._abort_all(live, "cancelled: the server is shutting down")
                if self.engine.has_unfinished_requests():
                    t = time.monotonic()
                    outs += self._step()
                    stats.step_s += time.monotonic() - t
                    stats.num_steps += 1
                t = time.monotonic()
                for request_id, group in by_request(outs).items():
                    self._deliver(live, request_id, group)
                stats.send_s += time.monotonic() - t
        finally:
            # Whatever escaped (an exception in delivery, a bug) still ends every request exactly once.
            for entry in live.values():
                if not entry.done:
                    self.engine.abort_request(entry.internal_id)
                    self.responder.fail(entry, RequestError("internal error: the batch ended without a final "
                                                            "response for this request", INTERNAL))
        stats.seconds = time.monotonic() - t0
        return stats

    # ---- stepping ---------------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - an engine fault ends this batch's requests, not the server
            log.exception("engine step failed; failing the whole batch")
            return self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")

    def _poll_cancellations(self, live: dict[str, LiveRequest]) -> list[RequestOutput]:
        """Once per step: a client that gave up frees its slot's KV now (the slot itself stays idle)."""
        cancelled = [e for e in live.values()
                     if not e.done and e.abort_reason is None and self.responder.is_cancelled(e)]
        return self._abort(cancelled, "cancelled by the client")

    def _abort_all(self, live: dict[str, LiveRequest], reason: str) -> list[RequestOutput]:
        return self._abort([e for e in live.values() if not e.done and e.abort_reason is None], reason)

    def _abort(self, entries: list[LiveRequest], reason: str) -> list[RequestOutput]:
        outs = []
        for entry in entries:
            entry.abort_reason = reason
            outs += self.engine.abort_request(entry.internal_id)
        return outs

    # ---- responses --------------------------------------------------------------------------------
    def _deliver(self, live: dict[str, LiveRequest], request_id: str, outs: list[RequestOutput]) -> None:
        entry = live.get(request_id)
        if entry is None or entry.done:
            return
        self.responder.absorb(entry, outs)
        if self.responder.is_over(entry):
            self.engine.abort_request(entry.internal_id)  # a sample failed: its siblings go too (else a no-op)
        self.responder.flush(entry)
