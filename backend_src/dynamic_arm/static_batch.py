"""Run the requests Triton batched together as ONE static batch to completion, streaming as tokens come.

Called from BatchLine's worker (batch_line.py) and returns only when every request of the batch has had its
final response. Transport-agnostic (the Triton model supplies the transport), so every path is testable without
a server.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from inflight.sequence import FinishReason, RequestOutput
from serving.contract import ParsedRequest
from serving.errors import INTERNAL, INVALID_ARG, RequestError
from serving.lifecycle import LiveRequest, RequestIds, Responder, Transport, UnloadWatch, by_request

from .cancel_relay import CancelRelay

log = logging.getLogger(__name__)


@dataclass
class BatchItem:
    sender: Any
    client_id: str  # Triton's request id; may be empty or repeat
    prompt_ids: list[int]
    req: ParsedRequest
    arrival_time: float | None = None  # time.monotonic() when the request reached the server (preprocessing)
    row_key: str = ""  # sent as `row_key` with every response; postprocessing posts it when the client cancels


@dataclass
class BatchStats:
    batch_size: int
    num_admitted: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    step_s: float = 0.0  # in engine.step()
    send_s: float = 0.0  # in transport.send() (IPC to the server, per response)
    poll_s: float = 0.0  # in transport.is_cancelled() (IPC to the server, per live request and step)
    relayed_cancels: int = 0  # rows aborted because postprocessing posted their key (cancel_relay.py)


class StaticBatchRunner:
    """Owns nothing but the engine's use during run(); one run at a time (Triton's execute thread).

    is_serving: probed (at most every serving_check_period_s) during a batch, through lifecycle.UnloadWatch;
    once the model is no longer served the batch is cancelled, so shutdown need not wait for it.
    relay: where postprocessing posts the keys of rows whose client cancelled the ensemble (cancel_relay.py).
    """

    def __init__(self, engine: LLMEngine, transport: Transport, is_serving: Callable[[], bool | None] | None = None,
                 serving_check_period_s: float = 1.0, relay: CancelRelay | None = None):
        if not engine.config.static_batching:
            raise ValueError("engine config static_batching=False is not allowed here: the dynamic-batcher arm "
                             "runs each batch as one static batch; set static_batching=True")
        self.engine = engine
        self.responder = Responder(transport, with_token_ids=True)
        self.unload_watch = UnloadWatch(is_serving, serving_check_period_s)
        self._ids = RequestIds()
        self.relay = relay
        self._row_keys: dict[str, str] = {}  # internal id -> row key, for the batch running

    def run(self, items: list[BatchItem]) -> BatchStats:
        t0 = time.monotonic()
        stats = BatchStats(batch_size=len(items))
        self.engine.metrics.on_batch(len(items))
        live: dict[str, LiveRequest] = {}
        self._row_keys = {}
        for item in items:
            entry = LiveRequest(self._ids.new(item.client_id), item.client_id, item.sender, item.req)
            if item.row_key:
                entry.extra_outputs["row_key"] = np.array([item.row_key.encode()], dtype=np.object_)
                self._row_keys[entry.internal_id] = item.row_key
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
                outs = self._poll_cancellations(live, stats)
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
            if self.relay is not None:
                for key in self._row_keys.values():
                    self.relay.clear(key)
                self.relay.sweep()
        stats.seconds = time.monotonic() - t0
        return stats

    # ---- stepping ---------------------------------------------------------------------------------
    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - an engine fault ends this batch's requests, not the server
            log.exception("engine step failed; failing the whole batch")
            return self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")

    def _poll_cancellations(self, live: dict[str, LiveRequest], stats: BatchStats) -> list[RequestOutput]:
        """Once per step: a client that gave up frees its slot's KV now (the slot itself stays idle). A cancel of
        the ensemble arrives through the relay; one of llm_dynamic itself, through Triton."""
        cancelled = []
        for e in live.values():
            if e.done or e.abort_reason is not None:
                continue
            if self._relayed(e):
                stats.relayed_cancels += 1
                self._end_relayed(e)
            elif self.responder.is_cancelled(e):
                cancelled.append(e)
        return self._abort(cancelled, "cancelled by the client")

    def _end_relayed(self, entry: LiveRequest) -> None:
        """A row whose client cancelled the ensemble ends with a final *data* response (finish reason
        "cancelled"), not a CANCELLED error: in Triton 2.51 an ensemble whose step fails while another of its
        steps is still in flight never completes (EnsembleContext::FinishEnsemble is not reached again), so the
        request would count as in flight for good and hold the server's stop for its exit timeout. Nobody reads
        this final: the client has gone."""
        entry.abort_reason = "cancelled by the client (through the ensemble)"
        self.engine.abort_request(entry.internal_id)  # frees its KV now; its CANCELLED output is not delivered
        for sample in entry.samples:
            if sample.finish_reason is None:
                sample.finish_reason = FinishReason.CANCELLED
        self.responder.flush(entry)

    def _relayed(self, entry: LiveRequest) -> bool:
        key = self._row_keys.get(entry.internal_id)
        return bool(key) and self.relay is not None and self.relay.is_posted(key)

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
