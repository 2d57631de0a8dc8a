"""Run the requests Triton batched together as ONE static batch to completion, streaming as tokens come.

Called from execute() and returns only when every request of the batch has had its final response:
an execute that returned early would let the dynamic batcher dispatch the next requests at once, and
the batches would collapse to size one. Transport-agnostic (the Triton model supplies the transport),
so every path is testable without a server.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from inflight.engine import LLMEngine
from inflight.sequence import FinishReason, InvalidRequestError, RequestOutput
from serving.contract import ParsedRequest
from serving.errors import CANCELLED, INTERNAL, INVALID_ARG, RequestError

if TYPE_CHECKING:
    from serving.frontend import Transport  # the same send/is_cancelled protocol as the in-flight arm

log = logging.getLogger(__name__)


@dataclass
class BatchItem:
    sender: Any
    client_id: str  # Triton's request id; may be empty or repeat
    prompt_ids: list[int]
    req: ParsedRequest


@dataclass
class _Live:
    item: BatchItem
    internal_id: str
    text: str = ""  # not streaming: the whole output so far
    token_ids: list[int] = field(default_factory=list)  # tokens not yet sent (all of them when not streaming)
    num_responses: int = 0
    abort_reason: str | None = None
    done: bool = False  # the final response went out: the sender must never be touched again


@dataclass
class BatchStats:
    batch_size: int
    num_admitted: int = 0
    num_steps: int = 0
    seconds: float = 0.0
    step_s: float = 0.0  # in engine.step()
    send_s: float = 0.0  # in transport.send() (IPC to the server, per response)
    poll_s: float = 0.0  # in transport.is_cancelled() (IPC to the server, per live request and step)


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def response_outputs(req: ParsedRequest, out: RequestOutput, text: str, token_ids: list[int],
                     first: bool, final: bool) -> dict[str, np.ndarray]:
    """One response of the internal interface (see dynamic_arm.interface); optional outputs only when asked."""
    if not req.exclude_input_in_output and first:
        text = req.prompt + text
    outputs = {"output_ids": np.array(token_ids, dtype=np.int32), "text_delta": _bytes(text)}
    if req.return_finish_reason and final:
        outputs["finish_reason"] = _bytes(out.finish_reason.openai)
    if req.return_num_input_tokens:
        outputs["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
    if req.return_num_output_tokens:
        outputs["num_output_tokens"] = np.array([len(token_ids)], dtype=np.uint32)
    if req.return_logprobs:
        outputs["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
    return outputs


class StaticBatchRunner:
    """Owns nothing but the engine's use during run(); one run at a time (Triton's execute thread).

    is_serving: probed every serving_check_period_s during a batch; False means the server is unloading the
    model, and the batch is cancelled so shutdown need not wait for it.
    """

    def __init__(self, engine: LLMEngine, transport: Transport, is_serving: Callable[[], bool] | None = None,
                 serving_check_period_s: float = 1.0):
        if not engine.config.static_batching:
            raise ValueError("engine config static_batching=False is not allowed here: the dynamic-batcher arm "
                             "runs each batch as one static batch; set static_batching=True")
        self.engine = engine
        self.transport = transport
        self.is_serving = is_serving
        self.serving_check_period_s = serving_check_period_s
        self._ids = itertools.count()

    def run(self, items: list[BatchItem]) -> BatchStats:
        t0 = time.monotonic()
        stats = BatchStats(batch_size=len(items))
        live: dict[str, _Live] = {}
        for item in items:
            entry = _Live(item, f"{item.client_id or 'request'}#{next(self._ids)}")
            try:
                seq = self.engine.make_sequence(entry.internal_id, item.prompt_ids, item.req.params, item.req.priority)
                self.engine.add_sequence(seq)
            except InvalidRequestError as e:  # this request only; the rest of the batch proceeds
                self._final_error(entry, RequestError(str(e), INVALID_ARG))
                continue
            live[entry.internal_id] = entry
        stats.num_admitted = len(live)
        next_serving_check = time.monotonic() + self.serving_check_period_s
        try:
            while self.engine.has_unfinished_requests():
                t = time.monotonic()
                outs = self._poll_cancellations(live)
                stats.poll_s += time.monotonic() - t
                if self.is_serving is not None and time.monotonic() >= next_serving_check:
                    next_serving_check = time.monotonic() + self.serving_check_period_s
                    if not self._still_serving():
                        outs += self._abort_all(live, "cancelled: the server is shutting down")
                if self.engine.has_unfinished_requests():
                    t = time.monotonic()
                    outs += self._step()
                    stats.step_s += time.monotonic() - t
                    stats.num_steps += 1
                t = time.monotonic()
                for out in outs:
                    self._deliver(live, out)
                stats.send_s += time.monotonic() - t
        finally:
            # Whatever escaped (an exception in delivery, a bug) still ends every request exactly once.
            for entry in live.values():
                if not entry.done:
                    if entry.internal_id in self.engine.seqs:
                        self.engine.abort_request(entry.internal_id)
                    self._final_error(entry, RequestError("internal error: the batch ended without a final "
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

    def _poll_cancellations(self, live: dict[str, _Live]) -> list[RequestOutput]:
        """Once per step: a client that gave up frees its slot's KV now (the slot itself stays idle)."""
        outs = []
        for entry in live.values():
            if entry.done or entry.abort_reason is not None:
                continue
            try:
                cancelled = bool(self.transport.is_cancelled(entry.item.sender))
            except Exception:  # noqa: BLE001 - treat a broken sender as gone
                log.exception("is_cancelled failed for %s", entry.internal_id)
                cancelled = True
            if cancelled:
                entry.abort_reason = "cancelled by the client"
                out = self.engine.abort_request(entry.internal_id)
                if out is not None:
                    outs.append(out)
        return outs

    def _abort_all(self, live: dict[str, _Live], reason: str) -> list[RequestOutput]:
        outs = []
        for entry in live.values():
            if not entry.done and entry.abort_reason is None:
                entry.abort_reason = reason
                out = self.engine.abort_request(entry.internal_id)
                if out is not None:
                    outs.append(out)
        return outs

    def _still_serving(self) -> bool:
        """is_serving() in this thread: every stub-to-server call of this model stays on the execute thread,
        since two threads making such calls at once abort the python backend (boost lock_exception)."""
        try:
            return bool(self.is_serving())
        except Exception:  # noqa: BLE001 - a probe that cannot answer must not cancel anything
            log.exception("is_serving probe failed; not probing again")
            self.is_serving = None
            return True

    # ---- responses --------------------------------------------------------------------------------
    def _deliver(self, live: dict[str, _Live], out: RequestOutput) -> None:
        entry = live.get(out.request_id)
        if entry is None or entry.done:
            return
        req = entry.item.req
        entry.token_ids += out.new_token_ids
        if out.finished:
            self._final(entry, out)
            return
        if not req.stream:
            entry.text += out.text_delta
            return
        if not out.text_delta:
            return  # held-back bytes of a partial character: no empty responses
        outputs = response_outputs(req, out, out.text_delta, entry.token_ids, entry.num_responses == 0, False)
        entry.token_ids = []
        entry.num_responses += 1
        try:
            self.transport.send(entry.item.sender, outputs, final=False)
        except Exception:  # noqa: BLE001 - e.g. the client went away; its final still follows
            log.exception("sending a response for %s failed", entry.internal_id)

    def _final(self, entry: _Live, out: RequestOutput) -> None:
        if out.finish_reason == FinishReason.ERROR:
            self._final_error(entry, RequestError(out.error or "engine error", INTERNAL))
            return
        if out.finish_reason == FinishReason.CANCELLED:
            name = f"request {entry.item.client_id!r}" if entry.item.client_id else "request"
            self._final_error(entry, RequestError(f"{name} {entry.abort_reason or 'cancelled'}", CANCELLED))
            return
        req = entry.item.req
        text = out.text_delta if req.stream else entry.text + out.text_delta
        outputs = response_outputs(req, out, text, entry.token_ids, entry.num_responses == 0, True)
        entry.done = True
        try:
            self.transport.send(entry.item.sender, outputs, final=True)
        except Exception as e:  # noqa: BLE001 - e.g. an output too large: the request still ends
            log.exception("final response for %s failed", entry.internal_id)
            entry.done = False
            self._final_error(entry, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL))

    def _final_error(self, entry: _Live, error: RequestError) -> None:
        entry.done = True
        try:
            self.transport.send(entry.item.sender, None, final=True, error=error)
        except Exception:  # noqa: BLE001 - nothing more can be done for this request
            log.exception("final error response failed: %s", error.message)
