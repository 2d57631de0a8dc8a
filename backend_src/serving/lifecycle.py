"""One request's way out, the same in both arms: its id, the responses built from engine outputs, exactly
one final (data, or an error with a Triton code), and the questions "did the client give up?" and "is this
model still served?". The in-flight frontend and the dynamic arm's static batches differ only in when they
step the engine; everything a client sees comes from here.
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from inflight.sequence import FinishReason, RequestOutput, TokenLogprobs

from .contract import ParsedRequest
from .errors import CANCELLED, INTERNAL, INVALID_ARG, RequestError

log = logging.getLogger(__name__)


class Transport(Protocol):
    """How responses leave. `send` with final=True must be the last call ever made for that sender."""

    def send(self, sender: Any, outputs: dict[str, np.ndarray] | None, final: bool,
             error: RequestError | None = None) -> None: ...

    def is_cancelled(self, sender: Any) -> bool: ...


@dataclass
class Sample:
    """One of a request's n samples, between responses."""
    text: str = ""  # not yet sent (streaming), or the whole output so far (not streaming)
    token_ids: list[int] = field(default_factory=list)  # likewise
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # theirs, when the request asked for logprobs
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0


@dataclass
class LiveRequest:
    """A request between its acceptance and its final response."""
    internal_id: str  # unique per engine; client ids may be empty or repeat
    client_id: str
    sender: Any
    req: ParsedRequest
    samples: list[Sample] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens from the prefix cache, as the first output said
    num_responses: int = 0
    abort_reason: str | None = None  # set once an abort was asked for, and why
    error: RequestError | None = None  # what ended the request, when it did not finish
    done: bool = False  # the final went out: the sender must never be touched again
    extra_outputs: dict[str, np.ndarray] = field(default_factory=dict)  # sent with every data response

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [Sample() for _ in range(self.req.params.n)]


class RequestIds:
    """Internal ids: the client's id (or 'request') and a counter, so repeated client ids never collide."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def new(self, client_id: str) -> str:
        return f"{client_id or 'request'}#{next(self._counter)}"


def _padded(rows: list[list[float]]) -> np.ndarray:
    """[samples, tokens], shorter rows padded with 0 (TensorRT-LLM pads its beams the same way)."""
    width = max(len(r) for r in rows)
    return np.array([r + [0.0] * (width - len(r)) for r in rows], dtype=np.float32)


class Responder:
    """Builds and sends one request's responses. The only code that touches a response sender.

    with_token_ids: each response also carries `output_ids` (the dynamic arm's postprocessing checks them).
    """

    def __init__(self, transport: Transport, with_token_ids: bool = False):
        self.transport = transport
        self.with_token_ids = with_token_ids

    def absorb(self, live: LiveRequest, outs: list[RequestOutput], shutting_down: bool = False) -> None:
        """One engine step's outputs for this request (one per sample that advanced); sends nothing."""
        for out in outs:
            if out.finish_reason == FinishReason.ERROR:
                # refused: the engine found the input bad after queueing it (a grammar that does not compile).
                live.error = live.error or RequestError(out.error or "engine error",
                                                        INVALID_ARG if out.refused else INTERNAL)
                continue
            if out.finish_reason == FinishReason.CANCELLED:
                why = live.abort_reason or ("cancelled: the server is shutting down" if shutting_down else "cancelled")
                live.error = live.error or RequestError(f"request {why}", CANCELLED)
                continue
            sample = live.samples[out.index]
            sample.text += out.text_delta
            sample.token_ids += out.new_token_ids
            sample.logprobs += out.logprobs or []
            sample.cumulative_logprob = out.cumulative_logprob
            live.num_prompt_tokens = out.num_prompt_tokens
            if live.num_cached_tokens is None:  # admission's count: a later preemption recounts its own blocks
                live.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                sample.finish_reason = out.finish_reason

    @staticmethod
    def is_over(live: LiveRequest) -> bool:
        """Every sample finished, or something ended the request: the next flush is its final."""
        return live.error is not None or all(s.finish_reason is not None for s in live.samples)

    def flush(self, live: LiveRequest) -> None:
        """Send what is due: the final (data or error) once the request is over, else, when streaming, the
        text the samples added (a step that completed no character sends nothing)."""
        if live.error is not None:
            self.fail(live, live.error)
            return
        final = self.is_over(live)
        if not final and (not live.req.stream or not any(s.text for s in live.samples)):
            return
        outputs = self.outputs(live, final)
        if live.req.stream:
            for s in live.samples:
                s.text, s.token_ids, s.logprobs = "", [], []
        live.num_responses += 1
        live.done = final
        try:
            self.transport.send(live.sender, outputs, final=final)
        except Exception as e:  # noqa: BLE001 - the client went away, or an output too large
            log.exception("sending a response for %s failed", live.internal_id)
            if final:  # the request still ends, once
                live.done = False
                self.fail(live, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL))

    def fail(self, live: LiveRequest, error: RequestError) -> None:
        live.done = True
        send_error(self.transport, live.sender, error, live.client_id)

    def outputs(self, live: LiveRequest, final: bool) -> dict[str, np.ndarray]:
        """One response's tensors, an element per sample (vLLM's layout for n); the optional ones, on every
        response, only when the request asked for them. Token counts and log-probabilities cover the tokens this
        response carries (all of them when not streaming), as in vLLM's backend."""
        req, samples = live.req, live.samples
        # The prompt leads a whole output; a stream never repeats it (both peers).
        prefix = req.prompt if not req.stream and not req.exclude_input_in_output else ""
        outputs = {"text_output": np.array([(prefix + s.text).encode("utf-8") for s in samples], dtype=np.object_)}
        if self.with_token_ids or req.return_output_ids:
            outputs["output_ids"] = np.array([t for s in samples for t in s.token_ids], dtype=np.int32)
        if req.return_finish_reason:  # vLLM's backend says "None" until a sample finishes
            outputs["finish_reason"] = np.array([(s.finish_reason.openai if s.finish_reason else "None").encode()
                                                 for s in samples], dtype=np.object_)
        if req.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([live.num_prompt_tokens], dtype=np.uint32)
        if req.return_num_cached_tokens:
            outputs["num_cached_tokens"] = np.array([live.num_cached_tokens or 0], dtype=np.uint32)
        if req.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([len(s.token_ids) for s in samples], dtype=np.uint32)
        if req.return_cumulative_logprob:
            outputs["cumulative_logprob"] = np.array([s.cumulative_logprob for s in samples], dtype=np.float32)
        if req.return_logprobs:
            outputs["logprobs"] = np.array([(logprobs_json(s.logprobs) if req.logprobs_requested else "null").encode()
                                            for s in samples], dtype=np.object_)
        if req.return_log_probs:  # TensorRT-LLM's names
            outputs["cum_log_probs"] = np.array([s.cumulative_logprob for s in samples], dtype=np.float32)
            outputs["output_log_probs"] = _padded([[t.logprob for t in s.logprobs] for s in samples])
        outputs.update(live.extra_outputs)
        return outputs

    def is_cancelled(self, live: LiveRequest) -> bool:
        """Did the client give up? A sender that cannot answer counts as gone."""
        try:
            return bool(self.transport.is_cancelled(live.sender))
        except Exception:  # noqa: BLE001 - treat a broken sender as gone
            log.exception("is_cancelled failed for %s", live.internal_id)
            return True


def logprobs_json(tokens: list[TokenLogprobs]) -> str:
    """vLLM's layout: per token, {token id: {"logprob", "rank", "decoded_token"}} for the sampled token and the
    top ones, most likely first."""
    return json.dumps([{str(tid): {"logprob": lp, "rank": rank, "decoded_token": text}
                        for tid, (lp, rank, text) in sorted(t.top.items(), key=lambda kv: kv[1][1])}
                       for t in tokens])


def by_request(outs: list[RequestOutput]) -> dict[str, list[RequestOutput]]:
    """A step's outputs grouped by request (a request's samples advance in the same step), in order."""
    groups: dict[str, list[RequestOutput]] = {}
    for out in outs:
        groups.setdefault(out.request_id, []).append(out)
    return groups


def naming_request(error: RequestError, client_id: str) -> RequestError:
    """The error with the client's request id at the end of its message: a gRPC stream delivers errors without
    the id, so on a shared stream this is how clients match them. (At the end: clients classify errors by how the
    message starts, "<field>=<value> ...".)"""
    return RequestError(f"{error.message} (request id {client_id!r})", error.code) if client_id else error


def send_error(transport: Transport, sender: Any, error: RequestError, client_id: str = "") -> None:
    """A request's one final, as an error naming the request (naming_request)."""
    error = naming_request(error, client_id)
    try:
        transport.send(sender, None, final=True, error=error)
    except Exception:  # noqa: BLE001 - nothing more can be done for this request
        log.exception("final error response failed: %s", error.message)


class UnloadWatch:
    """Is this model still served? Triton unloads a model (explicitly, or at shutdown) only once every request
    in flight has had its final, so a model that keeps working through its requests would hold shutdown up
    for --exit-timeout-secs. `probe` (serving.health_probe.HealthProbe) answers True, False or None (no
    answer); two Falses in a row, after a True was seen once, mean the model is being unloaded."""

    def __init__(self, probe: Callable[[], bool | None] | None, period_s: float = 0.5):
        self.probe = probe
        self.period_s = period_s
        self._seen_ready = False
        self._not_ready = 0
        self._next_check = 0.0
        self.unloading = False

    def check(self) -> bool:
        """True once unloading was seen; asks the probe at most once per period."""
        if self.unloading or self.probe is None or time.monotonic() < self._next_check:
            return self.unloading
        self._next_check = time.monotonic() + self.period_s
        try:
            ready = self.probe()
        except Exception:  # noqa: BLE001 - a broken probe is no answer
            log.exception("readiness check failed")
            ready = None
        if ready:
            self._seen_ready, self._not_ready = True, 0
        elif ready is False and self._seen_ready:
            self._not_ready += 1
            self.unloading = self._not_ready >= 2
        return self.unloading
