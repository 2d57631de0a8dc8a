"""The decoupled in-flight frontend: requests in, one engine loop, responses out, exactly one final each.

Transport-agnostic: the Triton model supplies a Transport that wraps pb_utils response senders, so the
bookkeeping here (internal ids, streaming deltas, cancellation, shutdown) is testable without a server.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from inflight.engine import EngineLoop, LLMEngine, QueueFullError
from inflight.sequence import FinishReason, InvalidRequestError, RequestOutput

from .contract import ContractLimits, ParsedRequest, parse_request
from .errors import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE, RequestError

__all__ = ["CANCELLED", "INTERNAL", "INVALID_ARG", "UNAVAILABLE", "InflightFrontend", "RequestError", "Transport"]
from .test_hooks import PARAMETER as FAULT_PARAMETER
from .test_hooks import FaultInjector, parse_fault

log = logging.getLogger(__name__)

class Transport(Protocol):
    """How responses leave. `send` with final=True must be the last call ever made for that sender."""

    def send(self, sender: Any, outputs: dict[str, np.ndarray] | None, final: bool,
             error: RequestError | None = None) -> None: ...

    def is_cancelled(self, sender: Any) -> bool: ...


@dataclass
class _InFlight:
    internal_id: str
    client_id: str
    sender: Any
    req: ParsedRequest
    text: str = ""  # non-stream: the whole output so far
    num_tokens_unsent: int = 0  # stream: tokens whose text has not gone out yet (held-back bytes)
    num_responses: int = 0
    abort_reason: str | None = None  # set once an abort was asked for, and why


def _bytes_tensor(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def finish_reason_text(reason: FinishReason) -> str:
    """vLLM/OpenAI spelling for the normal ends ('stop', 'length'); 'cancelled' and 'error' otherwise."""
    return reason.openai


class InflightFrontend:
    """Owns the engine loop thread, a sender thread and a cancellation poller.

    Invariant: a sender is touched (send, is_cancelled) only under self._lock while its entry is in
    self._inflight, except for the final send, which happens after the entry was removed under the lock;
    so nothing can touch a sender after its FINAL flag.

    `is_ready` (optional) asks the host whether this model is still being served. Triton unloads a model
    (at shutdown, or an explicit unload) only once every in-flight request has had its final, and it calls
    finalize() only after that; so when the host says the model is no longer served, every in-flight request
    is cancelled ("the model is being unloaded") and new ones are refused.
    `fault_injector` (tests only) becomes the engine's step_hook, armed by the `inject_fault` parameter.
    """

    def __init__(self, engine: LLMEngine, transport: Transport, limits: ContractLimits = ContractLimits(),
                 cancel_check_period_s: float = 0.1, is_ready: Callable[[], bool] | None = None,
                 ready_check_period_s: float = 0.5, fault_injector: FaultInjector | None = None):
        self.engine = engine
        self.transport = transport
        self.limits = limits
        self.cancel_check_period_s = cancel_check_period_s
        self.is_ready = is_ready
        self.ready_check_period_s = ready_check_period_s
        self.fault_injector = fault_injector
        if fault_injector is not None:
            engine.step_hook = fault_injector
        self._seen_ready = False
        self._not_ready_count = 0
        self._next_ready_check = 0.0
        self.unloading = threading.Event()
        self.loop = EngineLoop(engine, self._on_outputs)
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._sender_thread = threading.Thread(target=self._send_loop, name="inflight-sender", daemon=True)
        self._poller_thread = threading.Thread(target=self._poll_cancellations, name="inflight-cancel-poller",
                                               daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.loop.start()
        self._sender_thread.start()
        self._poller_thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the engine (every in-flight request gets its final), send those finals, join the threads."""
        self._closing.set()
        self.loop.stop(timeout_s)
        self._outbox.put(None)
        self._sender_thread.join(timeout_s)
        self._poller_thread.join(timeout_s)
        with self._lock:
            left = list(self._inflight.values())
            self._inflight.clear()
        for entry in left:  # only if the engine thread did not stop in time
            self._send_final_error(entry.sender, RequestError("server is shutting down", UNAVAILABLE), entry.client_id)

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ---- requests in (Triton's execute thread) ------------------------------------------------------
    def submit(self, sender: Any, client_id: str, inputs: Mapping[str, Any],
               parameters: Mapping[str, Any] | None = None) -> None:
        """Validate and enqueue one request; any refusal becomes that request's one final error response."""
        if self.unloading.is_set():
            self._send_final_error(sender, RequestError("the model is being unloaded: retry on a serving model",
                                                        UNAVAILABLE), client_id)
            return
        fault = None
        try:
            if self.fault_injector is not None and parameters and FAULT_PARAMETER in parameters:
                parameters = dict(parameters)
                fault = parse_fault(parameters.pop(FAULT_PARAMETER))
            req = parse_request(inputs, parameters, self.limits)
        except InvalidRequestError as e:
            self._send_final_error(sender, RequestError(str(e), INVALID_ARG), client_id)
            return
        if fault is not None:
            self.fault_injector.arm(fault)
        if req.cancel:
            self._cancel_by_client_id(sender, client_id)
            return
        internal_id = f"{client_id or 'request'}#{next(self._ids)}"  # client ids may repeat; ours do not
        entry = _InFlight(internal_id, client_id, sender, req)
        with self._lock:
            self._inflight[internal_id] = entry
        try:
            self.loop.add_request(internal_id, req.prompt, req.params, req.priority)
        except Exception as e:  # noqa: BLE001 - whatever add_request raises costs this request only
            if isinstance(e, QueueFullError):
                error = RequestError(str(e), UNAVAILABLE)
            elif isinstance(e, InvalidRequestError):
                error = RequestError(str(e), INVALID_ARG)
            else:
                log.exception("add_request failed for %s", internal_id)
                error = RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL)
            with self._lock:
                mine = self._inflight.pop(internal_id, None) is not None
            if mine:  # else close() took it and already sent its final
                self._send_final_error(sender, error, client_id)

    def _cancel_by_client_id(self, sender: Any, client_id: str) -> None:
        """TensorRT-LLM's stop=true: cancel the in-flight request(s) that carry this request id."""
        if not client_id:
            self._send_final_error(sender, RequestError(
                "stop=True (cancel) needs the request id of the request to cancel: allowed a non-empty id"))
            return
        with self._lock:
            targets = [e for e in self._inflight.values() if e.client_id == client_id and e.abort_reason is None]
            for entry in targets:
                entry.abort_reason = "cancelled by a stop request with the same id"
        for entry in targets:
            self.loop.abort_request(entry.internal_id)
        self.transport.send(sender, {"text_output": _bytes_tensor("")}, final=True)

    # ---- responses out (engine thread -> sender thread) -------------------------------------------
    def _on_outputs(self, outs: list[RequestOutput]) -> None:
        """Engine thread. Hands outputs to the sender thread: the engine must not wait on client IPC."""
        self._outbox.put(outs)

    def _send_loop(self) -> None:
        while True:
            outs = self._outbox.get()
            if outs is None:
                # close(): the loop has stopped, so nothing more can arrive; drain what is queued.
                while True:
                    try:
                        rest = self._outbox.get_nowait()
                    except queue.Empty:
                        return
                    if rest is not None:
                        self._handle(rest)
            self._handle(outs)

    def _handle(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            try:
                self._handle_one(out)
            except Exception:  # noqa: BLE001 - one broken response must not stop the others
                log.exception("sending a response for %s failed", out.request_id)

    def _handle_one(self, out: RequestOutput) -> None:
        if out.finished:
            with self._lock:
                entry = self._inflight.pop(out.request_id, None)
            if entry is None:
                return
            self._send_final(entry, out)
            return
        with self._lock:
            entry = self._inflight.get(out.request_id)
            if entry is None:
                return
            req = entry.req
            if not req.stream:
                entry.text += out.text_delta
                return
            entry.num_tokens_unsent += len(out.new_token_ids)
            if not out.text_delta:
                return  # held-back bytes of a partial character: no empty responses
            outputs = self._outputs(entry, out, out.text_delta, final=False)
            entry.num_tokens_unsent = 0
            entry.num_responses += 1
            self.transport.send(entry.sender, outputs, final=False)

    def _send_final(self, entry: _InFlight, out: RequestOutput) -> None:
        """The entry is already out of the in-flight map: this is the last touch of its sender."""
        reason = out.finish_reason
        if reason == FinishReason.ERROR:
            self._send_final_error(entry.sender, RequestError(out.error or "engine error", INTERNAL), entry.client_id)
            return
        if reason == FinishReason.CANCELLED:
            why = entry.abort_reason or ("cancelled: the server is shutting down" if self._closing.is_set()
                                         else "cancelled")
            self._send_final_error(entry.sender, RequestError(f"request {why}", CANCELLED), entry.client_id)
            return
        entry.num_tokens_unsent += len(out.new_token_ids)
        text = out.text_delta if entry.req.stream else entry.text + out.text_delta
        outputs = self._outputs(entry, out, text, final=True)
        try:
            self.transport.send(entry.sender, outputs, final=True)
        except Exception as e:  # noqa: BLE001 - e.g. an output too large: still end the request
            log.exception("final response for %s failed", entry.internal_id)
            self._send_final_error(entry.sender, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL),
                                   entry.client_id)

    def _outputs(self, entry: _InFlight, out: RequestOutput, text: str, final: bool) -> dict[str, np.ndarray]:
        req = entry.req
        if not req.exclude_input_in_output and entry.num_responses == 0:
            text = req.prompt + text  # the prompt leads the first (or only) response
        outputs = {"text_output": _bytes_tensor(text)}
        if req.return_finish_reason and final:
            outputs["finish_reason"] = _bytes_tensor(finish_reason_text(out.finish_reason))
        if req.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if req.return_num_output_tokens:
            # Streaming: the tokens this response carries (they add up to the total, as in vLLM's backend).
            n = entry.num_tokens_unsent if req.stream else out.num_output_tokens
            outputs["num_output_tokens"] = np.array([n], dtype=np.uint32)
        if req.return_logprobs:
            outputs["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
        return outputs

    def _send_final_error(self, sender: Any, error: RequestError, client_id: str = "") -> None:
        """The request's one final, as an error. The message ends with the client's request id: a gRPC
        stream delivers errors without the id, so on a shared stream this is how clients match them. (At the
        end: clients classify errors by how the message starts, "<field>=<value> ...".)"""
        if client_id:
            error = RequestError(f"{error.message} (request id {client_id!r})", error.code)
        try:
            self.transport.send(sender, None, final=True, error=error)
        except Exception:  # noqa: BLE001 - nothing more can be done for this request
            log.exception("final error response failed: %s", error.message)

    # ---- cancellation ------------------------------------------------------------------------------
    def _poll_cancellations(self) -> None:
        """Once per period (not per token), ask every in-flight sender whether its client gave up, and
        now and then the host whether the model is still served."""
        while not self._closing.wait(self.cancel_check_period_s):
            self._check_ready()
            for internal_id in self._requests_to_abort():
                self.loop.abort_request(internal_id)

    def _requests_to_abort(self) -> list[str]:
        """Ids of in-flight requests to abort now, each marked with why.

        A method of its own, not inline in the polling loop: a loop variable outlives its loop, and an idle
        poller would then hold the last entry, and with it a response sender, for good. Triton 2.51 keeps
        the model loaded while any sender is alive, so that one reference would block unload and shutdown.
        """
        unloading = self.unloading.is_set()
        to_abort = []
        with self._lock:
            for entry in self._inflight.values():
                if entry.abort_reason is not None:
                    continue
                if unloading:
                    entry.abort_reason = "cancelled: the model is being unloaded"
                elif self._is_cancelled(entry):
                    entry.abort_reason = "cancelled by the client"
                else:
                    continue
                to_abort.append(entry.internal_id)
        return to_abort

    def _check_ready(self) -> None:
        """Ask the host only while requests are in flight (only they can hold an unload up). is_ready gives
        True, False or None (no answer); two Falses in a row, after a True was seen once, mean unloading."""
        if self.is_ready is None or self.unloading.is_set() or time.monotonic() < self._next_ready_check:
            return
        with self._lock:
            if not self._inflight:
                return
        self._next_ready_check = time.monotonic() + self.ready_check_period_s
        try:
            ready = self.is_ready()
        except Exception:  # noqa: BLE001 - a broken probe is no answer
            log.exception("readiness check failed")
            ready = None
        if ready:
            self._seen_ready, self._not_ready_count = True, 0
        elif ready is False and self._seen_ready:
            self._not_ready_count += 1
            if self._not_ready_count >= 2:
                log.warning("the model is no longer served (unloading, or the server is stopping): cancelling %d "
                            "in-flight request(s) so that unloading can proceed", self.num_inflight)
                self.unloading.set()

    def _is_cancelled(self, entry: _InFlight) -> bool:
        try:
            return bool(self.transport.is_cancelled(entry.sender))
        except Exception:  # noqa: BLE001 - treat a broken sender as gone
            log.exception("is_cancelled failed for %s", entry.internal_id)
            return True
