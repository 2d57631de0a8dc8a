"""One engine step per Triton execute, over exactly the requests Triton's iterative sequence batcher handed in.

Triton decides who joins and who leaves; the engine's block manager, forward, sampler and detokenizer do the rest
(LLMEngine.step(members)). Transport-agnostic: the Triton model wraps each pb_utils request in a HandedRequest and
supplies the transport, so every path is tested without a server. What Triton 2.51 does around it (probed; the
list and the evidence are in docs/ab.md):

- a sequence holds one of the instance's max_batch_size slots from its first execute to its last; later ones wait
  in Triton's backlog;
- with the direct strategy, every slot up to the highest busy one is in each execute; an empty slot below it, and
  a request whose set of inputs differs from the lowest slot's, is a NULL request (correlation id 0);
- each execute hands a new response sender per request; releasing a request without RESCHEDULE ends its sequence;
- a client that cancels while its request waits between executes is answered CANCELLED by Triton itself and its
  request is not handed in again; the sender from its last execute then says is_cancelled();
- a sequence not re-enqueued within max_sequence_idle_microseconds loses its slot, its next reschedule fails
  inside Triton, and its client would never get a final.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError, RequestLimits
from inflight.sequence import RequestOutput, Sequence
from serving.contract import parse_request
from serving.errors import INTERNAL, INVALID_ARG, UNAVAILABLE, RequestError
from serving.lifecycle import LiveRequest, RequestIds, Responder, Transport, UnloadWatch, by_request, send_error
from serving.request_hooks import RequestHook

log = logging.getLogger(__name__)

MAX_ENDED_ELSEWHERE = 4096
GRAMMAR_WAIT_S = 0.01  # an execute with only grammar-waiting requests waits this long, or Triton spins executes


@dataclass
class HandedRequest:
    """One request of an execute, read from pb_utils by the model (inputs only when needed: a start)."""
    correlation_id: int  # 0: a NULL request padding a slot (direct strategy); never answered, never rescheduled
    is_start: bool  # the first execute of its sequence (TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
    client_id: str
    sender: Any  # this execute's response sender (None for a NULL request)
    read_inputs: Callable[[], tuple[Mapping[str, np.ndarray], Mapping[str, Any]]]  # tensors (batch dim 1), params


@dataclass
class TrackedSequence:
    live: LiveRequest
    correlation_id: int
    enqueued_at: float  # when Triton last (re)queued it, at the latest: the end of the execute that rescheduled it


@dataclass
class ExecuteStats:
    num_handed: int = 0
    num_null: int = 0  # NULL padding requests
    num_new: int = 0  # sequences that started (accepted or refused)
    num_absent: int = 0  # live sequences Triton did not hand in (held back: their inputs differ from the lead's)
    num_cancelled_between: int = 0  # sequences Triton cancelled between executes (it answered them)
    num_rescheduled: int = 0
    step_s: float = 0.0
    seconds: float = 0.0


def _drop_batch_dim(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The sequence batcher hands one request per batch row: every input is [1, ...]; the contract reads [...]"""
    rows = {}
    for name, array in inputs.items():
        array = np.asarray(array)
        if array.ndim == 0 or array.shape[0] != 1:
            raise InvalidRequestError(f"{name}=<tensor of shape {list(array.shape)}> is invalid: allowed a batch "
                                      f"dimension of 1 first (the sequence batcher takes one request per row)")
        rows[name] = array[0]
    return rows


class IterativeStepRunner:
    """Owns the live sequences between executes (correlation id -> TrackedSequence); one execute at a time.

    Invariant: a sender is touched only while its sequence is tracked, and a final removes the sequence, so nothing
    touches a sender after its FINAL flag. A tracked sequence's sender is the one of the last execute that handed it
    in (the previous one is dropped, which deletes its response factory).
    """

    def __init__(self, engine: LLMEngine, transport: Transport, limits: RequestLimits = RequestLimits(),
                 request_defaults: Mapping[str, Any] | None = None, idle_timeout_s: float = 3600.0,
                 is_serving: Callable[[], bool | None] | None = None, serving_check_period_s: float = 1.0,
                 request_hook: RequestHook | None = None):
        self.engine = engine
        self.transport = transport
        self.responder = Responder(transport)
        self.limits = limits
        self.request_defaults = dict(request_defaults or {})
        self.idle_timeout_s = idle_timeout_s
        # Triton re-enqueues a rescheduled request a little after execute returns: count that in, generously.
        self.idle_margin_s = min(0.5 * idle_timeout_s, max(0.05, 0.1 * idle_timeout_s))
        self.unload_watch = UnloadWatch(is_serving, serving_check_period_s)
        self.request_hook = request_hook
        if request_hook is not None:
            request_hook.attach(engine)
        self._ids = RequestIds()
        self.sequences: dict[int, TrackedSequence] = {}
        self._by_internal: dict[str, int] = {}  # internal id -> correlation id
        self._lock = threading.Lock()  # execute() and the idle poller never touch the state at once
        self._last_execute_end = time.monotonic()
        self._stop_poller = threading.Event()
        self._poller: threading.Thread | None = None
        self.num_cancelled_between = 0  # all along, found by executes and by the idle poller
        # Sequences that got their final on an earlier execute's sender while Triton still held their request (a
        # cancel by id, an error while held back, unload): that request comes back once more and is let go.
        self._ended_elsewhere: dict[int, None] = {}

    @property
    def num_live(self) -> int:
        return len(self.sequences)

    # ---- one execute --------------------------------------------------------------------------------
    def execute(self, handed: list[HandedRequest]) -> tuple[list[bool], ExecuteStats]:
        """Run one step over the handed requests; returns, per handed request, whether to reschedule it."""
        with self._lock:
            try:
                return self._execute(handed)
            finally:
                self._last_execute_end = time.monotonic()

    def _execute(self, handed: list[HandedRequest]) -> tuple[list[bool], ExecuteStats]:
        t0 = time.monotonic()
        stats = ExecuteStats(num_handed=len(handed))
        present: dict[int, tuple[int, TrackedSequence]] = {}
        handed_ids = {r.correlation_id for r in handed if r.correlation_id}
        self._forget_cancelled(handed_ids, stats)  # first: their KV blocks go back before new sequences ask
        outs: list[RequestOutput] = []
        for index, request in enumerate(handed):
            cid = request.correlation_id
            if not cid:
                stats.num_null += 1
                continue
            tracked = self.sequences.get(cid)
            if request.is_start:
                stats.num_new += 1
                if tracked is not None:  # a client's own sequence_id, reused while its sequence runs: Triton
                    self._refuse_foreign(request, tracked)  # queues it in the same slot; this one ends now
                    continue
                tracked = self._start(request, t0, outs)
                if tracked is None:
                    continue  # refused: its one final is out
            elif tracked is None or tracked.live.client_id != request.client_id:
                if not self._forget_ended_elsewhere(cid):  # not ours to let go silently: say why
                    self._refuse_foreign(request, tracked)
                continue
            else:
                tracked.live.sender = request.sender
            present[cid] = (index, tracked)
        if self.unload_watch.check():
            outs += self._abort(list(self.sequences.values()), "cancelled: the model is being unloaded")
        members = self._members(present)
        if members:
            self.engine.metrics.on_batch(len(present))
            t = time.monotonic()
            outs += self._step(members)
            stats.step_s = time.monotonic() - t
            if not outs:
                self._wait_for_grammars(members)
        self._deliver(outs, set(present))
        reschedule = [False] * len(handed)
        now = time.monotonic()
        for index, tracked in present.values():
            if tracked.live.done:
                continue
            if now + self.idle_margin_s - tracked.enqueued_at >= self.idle_timeout_s:
                self._end_idle(tracked, now)
                continue
            reschedule[index] = True
            tracked.enqueued_at = now
            stats.num_rescheduled += 1
        stats.seconds = time.monotonic() - t0
        return reschedule, stats

    def close(self, reason: str = "cancelled: the model is being unloaded") -> None:
        """Unload: stop the idle poller, then end every live sequence (end_all)."""
        self._stop_poller.set()
        if self._poller is not None:
            self._poller.join(5.0)
        self.end_all(reason)

    def end_all(self, reason: str) -> None:
        """Every live sequence gets its final (CANCELLED) on the last sender it was handed with; the idle poller
        keeps running (after a failed execute the model still serves, and only the poller frees a sequence whose
        client cancels when no execute follows). Triton still holds the requests it did not hand in: each comes
        back once and is let go; those it released never come back (their entries age out)."""
        with self._lock:
            self._deliver(self._abort(list(self.sequences.values()), reason), present=set())
            for tracked in list(self.sequences.values()):  # only if the engine had nothing to say for it
                self.responder.fail(tracked.live, RequestError(f"request {reason}", UNAVAILABLE))
                self._drop(tracked)
                self._remember_ended_elsewhere(tracked.correlation_id)

    # ---- between executes ---------------------------------------------------------------------------
    def start_idle_poller(self, period_s: float) -> None:
        """A client that cancels the last live request leaves Triton with nothing to execute, so no execute would
        ever free its KV: while no execute has run for `period_s`, ask the live sequences' last senders."""
        def run() -> None:
            while not self._stop_poller.wait(period_s):
                self.poll_idle(period_s)
        self._poller = threading.Thread(target=run, name="iterative-idle-poller", daemon=True)
        self._poller.start()

    def poll_idle(self, idle_s: float) -> int:
        """Free the sequences Triton cancelled, if no execute runs now or ran in the last idle_s; returns how many."""
        if not self.sequences or not self._lock.acquire(blocking=False):
            return 0
        try:
            if time.monotonic() - self._last_execute_end < idle_s:
                return 0
            stats = ExecuteStats()
            self._forget_cancelled(set(), stats)
            return stats.num_cancelled_between
        finally:
            self._lock.release()

    # ---- joining ------------------------------------------------------------------------------------
    def _start(self, request: HandedRequest, now: float, outs: list[RequestOutput]) -> TrackedSequence | None:
        """Parse and add a sequence's first request; a refusal is its one final error (never rescheduled)."""
        hooked, hook = False, self.request_hook
        try:
            inputs, parameters = request.read_inputs()
            inputs = _drop_batch_dim(inputs)
            if hook is not None and parameters and hook.parameter in parameters:
                parameters = dict(parameters)
                hooked, claimed = True, hook.parse(parameters.pop(hook.parameter))
            req = parse_request(inputs, parameters, self.limits, self.request_defaults)
        except InvalidRequestError as e:
            send_error(self.transport, request.sender, RequestError(str(e), INVALID_ARG), request.client_id)
            return None
        except Exception as e:  # noqa: BLE001 - an unreadable request costs that request only
            send_error(self.transport, request.sender, RequestError(f"unreadable request: {e}", INVALID_ARG),
                       request.client_id)
            return None
        if hooked:
            hook.apply(claimed)
        if req.cancel:
            outs += self._cancel_by_client_id(request)
            return None
        live = LiveRequest(self._ids.new(request.client_id), request.client_id, request.sender, req)
        try:
            seq = self.engine.make_sequence(live.internal_id, req.prompt, req.params, req.priority,
                                            apply_chat_template=req.apply_chat_template)
            self.engine.add_sequence(seq)
        except InvalidRequestError as e:
            self.responder.fail(live, RequestError(str(e), INVALID_ARG))
            return None
        except Exception as e:  # noqa: BLE001 - whatever the engine raises costs this request only
            log.exception("adding %s failed", live.internal_id)
            self.responder.fail(live, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL))
            return None
        tracked = TrackedSequence(live, request.correlation_id, now)
        self.sequences[request.correlation_id] = tracked
        self._by_internal[live.internal_id] = request.correlation_id
        return tracked

    def _cancel_by_client_id(self, request: HandedRequest) -> list[RequestOutput]:
        """TensorRT-LLM's stop=true: cancel the live sequence(s) with this request id; the stop request itself gets
        an empty final. A cancelled sequence's request comes back once more and is let go (not a start)."""
        if not request.client_id:
            send_error(self.transport, request.sender, RequestError(
                "stop=True (cancel) needs the request id of the request to cancel: allowed a non-empty id"))
            return []
        targets = [t for t in self.sequences.values() if t.live.client_id == request.client_id]
        outs = self._abort(targets, "cancelled by a stop request with the same id")
        self._answer_stop(request)
        return outs

    def _answer_stop(self, request: HandedRequest) -> None:
        """The stop request's own final: empty data. A failed send costs this request only (raised, it would end
        the execute, and with it every live sequence)."""
        try:
            self.transport.send(request.sender, {"text_output": np.array([b""], dtype=np.object_)}, final=True)
        except Exception as e:  # noqa: BLE001 - the client went away, or Triton refused the response
            log.exception("the final of a stop request (request id %r) failed", request.client_id)
            send_error(self.transport, request.sender, RequestError(f"internal error: {type(e).__name__}: {e}",
                                                                    INTERNAL), request.client_id)

    # ---- leaving ------------------------------------------------------------------------------------
    def _forget_cancelled(self, handed_ids: set[int], stats: ExecuteStats) -> None:
        """Live sequences Triton did not hand in: either held back this execute (their inputs differ from the
        lead's: Triton put a NULL in their slot) or cancelled while queued, which Triton answered itself. The sender
        of their last execute tells which; a cancelled one gives its KV back, and its sender is never used again."""
        for cid, tracked in list(self.sequences.items()):
            if cid in handed_ids:
                continue
            if self.responder.is_cancelled(tracked.live):
                stats.num_cancelled_between += 1
                self.num_cancelled_between += 1
                tracked.live.done = True  # Triton sent its final: never touch the sender again
                self.engine.abort_request(tracked.live.internal_id)  # its CANCELLED output goes nowhere
                self._drop(tracked)
            else:
                stats.num_absent += 1

    def _end_idle(self, tracked: TrackedSequence, now: float) -> None:
        """Rescheduling it now would fail inside Triton (its slot was released as idle), leaving the client without a
        final: end it here instead, with an error that says which setting to raise."""
        waited = now - tracked.enqueued_at
        log.warning("%s: %.3f s since Triton last queued it, max_sequence_idle_microseconds=%d: ending it",
                    tracked.live.internal_id, waited, round(self.idle_timeout_s * 1e6))
        self.engine.abort_request(tracked.live.internal_id)
        self.responder.fail(tracked.live, RequestError(
            f"sequence idle for {waited:.3f} s between two of its executes, past max_sequence_idle_microseconds="
            f"{round(self.idle_timeout_s * 1e6)}: Triton's sequence batcher has released it; allowed steps shorter "
            f"than the idle timeout (raise max_sequence_idle_microseconds in the model config)", UNAVAILABLE))
        self._drop(tracked)

    def _abort(self, targets: list[TrackedSequence], reason: str) -> list[RequestOutput]:
        outs = []
        for tracked in targets:
            live = tracked.live
            if live.done or live.abort_reason is not None:
                continue
            live.abort_reason = reason
            outs += self.engine.abort_request(live.internal_id)
        return outs

    def _drop(self, tracked: TrackedSequence) -> None:
        self.sequences.pop(tracked.correlation_id, None)
        self._by_internal.pop(tracked.live.internal_id, None)

    def _refuse_foreign(self, request: HandedRequest, tracked: TrackedSequence | None) -> None:
        """A request that is not the next step of a live sequence here: a client sent its own sequence_id (as
        perf_analyzer does for any sequence-batched model) for a second request. Each request is a sequence of its
        own in this model; this one gets its error final and is not rescheduled."""
        live = "" if tracked is None else f", live with request id {tracked.live.client_id!r}"
        send_error(self.transport, request.sender, RequestError(
            f"sequence_id={request.correlation_id!r} (start={request.is_start}) is not a new sequence nor the next "
            f"step of one{live}: allowed no sequence_id (Triton then gives each request its own), or a fresh one "
            f"with sequence_start=true", INVALID_ARG), request.client_id)
    # ---- the step -----------------------------------------------------------------------------------
    def _members(self, present: dict[int, tuple[int, TrackedSequence]]) -> set[Sequence]:
        """Every live sample of the handed requests (a request with n > 1 runs n sequences)."""
        engine = self.engine
        return {engine.seqs[sid] for _, tracked in present.values() if not tracked.live.done
                for sid in engine.groups.get(tracked.live.internal_id, ())}

    def _step(self, members: set[Sequence]) -> list[RequestOutput]:
        try:
            return self.engine.step(members)
        except Exception as e:  # noqa: BLE001 - an engine fault ends the live requests, not the server
            log.exception("engine step failed; failing every live request")
            return self.engine.fail_all(f"engine error: {type(e).__name__}: {e}")

    def _wait_for_grammars(self, members: set[Sequence]) -> None:
        """A step that ran nothing because its requests' grammars still compile: wait a little for one, else
        Triton hands the same requests straight back and the execute loop spins a core."""
        pending = [s.grammar.future for s in members if s.waits_for_grammar and s.grammar is not None]
        if pending:
            concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    def _deliver(self, outs: list[RequestOutput], present: set | None = None) -> None:
        """Send each output on its sequence's sender. A final for a sequence not handed in this execute went out on
        its last execute's sender while Triton still holds its request: remember to let that request go."""
        for request_id, group in by_request(outs).items():
            cid = self._by_internal.get(request_id)
            tracked = self.sequences.get(cid) if cid is not None else None
            if tracked is None or tracked.live.done:
                continue
            live = tracked.live
            self.responder.absorb(live, group)
            if self.responder.is_over(live):
                self.engine.abort_request(live.internal_id)  # a sample failed: its siblings go too (else a no-op)
            self.responder.flush(live)
            if live.done:
                self._drop(tracked)
                if present is not None and tracked.correlation_id not in present:
                    self._remember_ended_elsewhere(tracked.correlation_id)

    def _remember_ended_elsewhere(self, correlation_id: int) -> None:
        self._ended_elsewhere[correlation_id] = None
        while len(self._ended_elsewhere) > MAX_ENDED_ELSEWHERE:  # requests Triton dropped meanwhile
            del self._ended_elsewhere[next(iter(self._ended_elsewhere))]

    def _forget_ended_elsewhere(self, correlation_id: int) -> bool:
        """Whether this sequence got its final elsewhere (its request is back once more); forgets it."""
        if correlation_id not in self._ended_elsewhere:
            return False
        del self._ended_elsewhere[correlation_id]
        return True
