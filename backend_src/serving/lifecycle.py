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
from .errors import CANCELLED, INTERNAL, RequestError

log = logging.getLogger(__name__)


class Transport(Protocol):
    """How responses leave. `send` with final=True must be the last call ever made for that sender."""

    def send(self, sender: Any, outputs: dict[str, np.ndarray] | None, final: bool,
             error: RequestError | None = None) -> None: ...

    def is_cancelled(self, sender: Any) -> bool: ...


@dataclass
class LiveRequest:
    """A request between its acceptance and its final response."""
    internal_id: str  # unique per engine; client ids may be empty or repeat
    client_id: str
    sender: Any
    req: ParsedRequest
    text: str = ""  # not streaming: the whole output so far
    token_ids: list[int] = field(default_factory=list)  # tokens not yet sent (all of them when not streaming)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # theirs, when the request asked for logprobs
    num_responses: int = 0
    abort_reason: str | None = None  # set once an abort was asked for, and why
    done: bool = False  # the final went out: the sender must never be touched again


class RequestIds:
    """Internal ids: the client's id (or 'request') and a counter, so repeated client ids never collide."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def new(self, client_id: str) -> str:
        return f"{client_id or 'request'}#{next(self._counter)}"


def _bytes_tensor(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


class Responder:
    """Builds and sends one request's responses. The only code that touches a response sender.

    with_token_ids: each response also carries `output_ids` (the dynamic arm's postprocessing checks them).
    """

    def __init__(self, transport: Transport, with_token_ids: bool = False):
        self.transport = transport
        self.with_token_ids = with_token_ids

    def progress(self, live: LiveRequest, out: RequestOutput) -> None:
        """A non-final engine output: stream its text now, or keep it for the final response."""
        live.token_ids += out.new_token_ids
        live.logprobs += out.logprobs or []
        if not live.req.stream:
            live.text += out.text_delta
            return
        if not out.text_delta:
            return  # held-back bytes of a partial character: no empty responses
        outputs = self.outputs(live, out, out.text_delta, final=False)
        live.token_ids, live.logprobs = [], []
        live.num_responses += 1
        try:
            self.transport.send(live.sender, outputs, final=False)
        except Exception:  # noqa: BLE001 - e.g. the client went away; its final still follows
            log.exception("sending a response for %s failed", live.internal_id)

    def finish(self, live: LiveRequest, out: RequestOutput, shutting_down: bool = False) -> None:
        """The final engine output: the last response, or the error that ended the request."""
        if out.finish_reason == FinishReason.ERROR:
            self.fail(live, RequestError(out.error or "engine error", INTERNAL))
            return
        if out.finish_reason == FinishReason.CANCELLED:
            why = live.abort_reason or ("cancelled: the server is shutting down" if shutting_down else "cancelled")
            self.fail(live, RequestError(f"request {why}", CANCELLED))
            return
        live.token_ids += out.new_token_ids
        live.logprobs += out.logprobs or []
        text = out.text_delta if live.req.stream else live.text + out.text_delta
        outputs = self.outputs(live, out, text, final=True)
        live.done = True
        try:
            self.transport.send(live.sender, outputs, final=True)
        except Exception as e:  # noqa: BLE001 - e.g. an output too large: the request still ends
            log.exception("final response for %s failed", live.internal_id)
            live.done = False
            self.fail(live, RequestError(f"internal error: {type(e).__name__}: {e}", INTERNAL))

    def fail(self, live: LiveRequest, error: RequestError) -> None:
        live.done = True
        send_error(self.transport, live.sender, error, live.client_id)

    def outputs(self, live: LiveRequest, out: RequestOutput, text: str, final: bool) -> dict[str, np.ndarray]:
        """One response's tensors; the optional ones, on every response, only when the request asked for them.
        Token counts and log-probabilities cover the tokens this response carries (all of them when not
        streaming), as in vLLM's backend."""
        req = live.req
        if not req.stream and not req.exclude_input_in_output:
            text = req.prompt + text  # the prompt leads a whole output; a stream never repeats it (both peers)
        outputs = {"text_output": _bytes_tensor(text)}
        if self.with_token_ids:
            outputs["output_ids"] = np.array(live.token_ids, dtype=np.int32)
        if req.return_finish_reason:  # vLLM's backend says "None" until the request finishes
            outputs["finish_reason"] = _bytes_tensor(out.finish_reason.openai if final else "None")
        if req.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
        if req.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([len(live.token_ids)], dtype=np.uint32)
        if req.return_cumulative_logprob:
            outputs["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
        if req.return_logprobs:
            outputs["logprobs"] = _bytes_tensor(logprobs_json(live.logprobs) if req.logprobs_requested else "null")
        if req.return_log_probs:  # TensorRT-LLM's names
            outputs["cum_log_probs"] = np.array([out.cumulative_logprob], dtype=np.float32)
            outputs["output_log_probs"] = np.array([t.logprob for t in live.logprobs], dtype=np.float32)
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


def send_error(transport: Transport, sender: Any, error: RequestError, client_id: str = "") -> None:
    """A request's one final, as an error. The message ends with the client's request id: a gRPC stream
    delivers errors without the id, so on a shared stream this is how clients match them. (At the end:
    clients classify errors by how the message starts, "<field>=<value> ...".)"""
    if client_id:
        error = RequestError(f"{error.message} (request id {client_id!r})", error.code)
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
