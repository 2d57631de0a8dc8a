"""The decoupled in-flight frontend: requests in, one engine loop, responses out, exactly one final each.

Transport-agnostic: the Triton model supplies a Transport that wraps pb_utils response senders, so the
bookkeeping here (internal ids, streaming deltas, cancellation, shutdown) is testable without a server.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Mapping

import numpy as np

from inflight.engine import EngineLoop, LLMEngine, QueueFullError
from inflight.fields import InvalidRequestError, RequestLimits
from inflight.sequence import RequestOutput

from .contract import parse_request
from .errors import INTERNAL, INVALID_ARG, UNAVAILABLE, RequestError
from .lifecycle import LiveRequest, RequestIds, Responder, Transport, UnloadWatch, by_request, send_error
from .request_hooks import RequestHook

log = logging.getLogger(__name__)


class InflightFrontend:
    """Owns the engine loop thread, a sender thread and a cancellation poller.

    Invariant: a sender is touched (send, is_cancelled) only under self._lock while its entry is in
    self._inflight, except for the final send, which happens after the entry was removed under the lock;
    so nothing can touch a sender after its FINAL flag.

    `is_ready` (optional) asks the host whether this model is still served (see lifecycle.UnloadWatch): once
    it is not, every in-flight request is cancelled ("the model is being unloaded") and new ones are refused.
    `request_hook` (tests only; see request_hooks) claims one request parameter and may act on the engine,
    e.g. the fault tests' hook arms engine.step_hook from `inject_fault`.
    """

    def __init__(self, engine: LLMEngine, transport: Transport, limits: RequestLimits = RequestLimits(),
                 cancel_check_period_s: float = 0.1, is_ready: Callable[[], bool | None] | None = None,
                 ready_check_period_s: float = 0.5, request_hook: RequestHook | None = None,
                 request_defaults: Mapping[str, Any] | None = None):
        self.engine = engine
        self.transport = transport
        self.responder = Responder(transport)
        self.limits = limits
        self.request_defaults = dict(request_defaults or {})  # the model's defaults for serving flags
        self.cancel_check_period_s = cancel_check_period_s
        self.unload_watch = UnloadWatch(is_ready, ready_check_period_s)
        self.request_hook = request_hook
        if request_hook is not None:
            request_hook.attach(engine)
        self.unloading = threading.Event()
        self.loop = EngineLoop(engine, self._on_outputs)
        self._lock = threading.Lock()
        self._inflight: dict[str, LiveRequest] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._ids = RequestIds()
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
        for live in left:  # only if the engine thread did not stop in time
            self.responder.fail(live, RequestError("server is shutting down", UNAVAILABLE))

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ---- requests in (Triton's execute thread) ------------------------------------------------------
    def submit(self, sender: Any, client_id: str, inputs: Mapping[str, Any],
               parameters: Mapping[str, Any] | None = None) -> None:
        """Validate and enqueue one request; any refusal becomes that request's one final error response."""
        if self.unloading.is_set():
            send_error(self.transport, sender, RequestError("the model is being unloaded: retry on a serving model",
                                                            UNAVAILABLE), client_id)
            return
        hooked, hook = False, self.request_hook
        try:
            if hook is not None and parameters and hook.parameter in parameters:
                parameters = dict(parameters)
                hooked, claimed = True, hook.parse(parameters.pop(hook.parameter))
            req = parse_request(inputs, parameters, self.limits, self.request_defaults)
        except InvalidRequestError as e:
            send_error(self.transport, sender, RequestError(str(e), INVALID_ARG), client_id)
            return
        if hooked:  # only a request that was accepted acts
            hook.apply(claimed)
        if req.cancel:
            self._cancel_by_client_id(sender, client_id)
            return
        live = LiveRequest(self._ids.new(client_id), client_id, sender, req)
        with self._lock:
            self._inflight[live.internal_id] = live
        try:
            self.loop.add_request(live.internal_id, req.prompt, req.params, req.priority, req.apply_chat_template)
        except Exception as e:  # noqa: BLE001 - whatever add_request raises costs this request only
            if isinstance(e, QueueFullError):
                error = RequestError(str(e), UNAVAILABLE)
            elif isinstance(e, InvalidRequestError):
                error = RequestError(str(e), INVALID_ARG)
            else:
                log.exception("add_request failed for %s", live.internal_id)
                error = RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL)
            with self._lock:
                mine = self._inflight.pop(live.internal_id, None) is not None
            if mine:  # else close() took it and already sent its final
                self.responder.fail(live, error)

    def _cancel_by_client_id(self, sender: Any, client_id: str) -> None:
        """TensorRT-LLM's stop=true: cancel the in-flight request(s) that carry this request id."""
        if not client_id:
            send_error(self.transport, sender, RequestError(
                "stop=True (cancel) needs the request id of the request to cancel: allowed a non-empty id"))
            return
        with self._lock:
            targets = [e for e in self._inflight.values() if e.client_id == client_id and e.abort_reason is None]
            for live in targets:
                live.abort_reason = "cancelled by a stop request with the same id"
        for live in targets:
            self.loop.abort_request(live.internal_id)
        self._answer_stop(sender, client_id)

    def _answer_stop(self, sender: Any, client_id: str) -> None:
        """The stop request's own final: empty data. A failed send costs this request only (raised, it would leave
        the model's execute, and the requests after it there would never be submitted)."""
        try:
            self.transport.send(sender, {"text_output": np.array([b""], dtype=np.object_)}, final=True)
        except Exception as e:  # noqa: BLE001 - the client went away, or Triton refused the response
            log.exception("the final of a stop request (request id %r) failed", client_id)
            send_error(self.transport, sender, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL),
                       client_id)

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
        for request_id, group in by_request(outs).items():
            try:
                self._handle_request(request_id, group)
            except Exception:  # noqa: BLE001 - one broken response must not stop the others
                log.exception("sending a response for %s failed", request_id)

    def _handle_request(self, request_id: str, outs: list[RequestOutput]) -> None:
        with self._lock:
            live = self._inflight.get(request_id)
            if live is None:
                return
            self.responder.absorb(live, outs, shutting_down=self._closing.is_set())
            over = self.responder.is_over(live)
            if not over:
                self.responder.flush(live)
                return
            del self._inflight[request_id]
        if not all(s.finish_reason for s in live.samples):  # a sample failed: its siblings go too
            self.loop.abort_request(request_id)
        self.responder.flush(live)  # out of the map: this is the last touch of its sender

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
            for live in self._inflight.values():
                if live.abort_reason is not None:
                    continue
                if unloading:
                    live.abort_reason = "cancelled: the model is being unloaded"
                elif self.responder.is_cancelled(live):
                    live.abort_reason = "cancelled by the client"
                else:
                    continue
                to_abort.append(live.internal_id)
        return to_abort

    def _check_ready(self) -> None:
        """Ask the host only while requests are in flight: only they can hold an unload up."""
        if self.unloading.is_set():
            return
        with self._lock:
            if not self._inflight:
                return
        if self.unload_watch.check():
            log.warning("the model is no longer served (unloading, or the server is stopping): cancelling %d "
                        "in-flight request(s) so that unloading can proceed", self.num_inflight)
            self.unloading.set()
