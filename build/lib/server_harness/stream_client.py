"""A gRPC streaming client that counts final responses per request id (fault tests and the soak).

Triton marks the last response of a decoupled request with the response parameter
`triton_final_response`; an error response is always the last one (the llm model sends errors only as
finals, and Triton's own refusals end the request). Errors arrive without an id, so they are matched by
the id the llm model puts at their end, "(request id 'ID')", or Triton's prefix "[request id: ID]".
A few of Triton's refusals name no id ("unexpected inference input ..."): with `anonymous_errors=True`
(one request per stream) such an error is that request's final. A broken stream ("[StatusCode...]") is
never anyone's final.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

_ERROR_ID = re.compile(r"\(request id '([^']*)'\)$|^\[request id: ([^\]]*)\]")
_WIRE = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}


def make_inputs(prompt: Any, values: dict[str, Any]) -> list[grpcclient.InferInput]:
    """text_input (str, bytes, or a ready numpy array; None: left out) plus typed inputs from values:
    bool -> BOOL, int -> INT32 (seed: UINT64), float -> FP32, str/bytes/list -> BYTES, ndarray as given."""
    items = dict(values) if prompt is None else {"text_input": prompt, **values}
    inputs = []
    for name, value in items.items():
        if isinstance(value, np.ndarray):
            arr = value
            wire = "BYTES" if arr.dtype == np.object_ else grpcclient.np_to_triton_dtype(arr.dtype)
        elif isinstance(value, (str, bytes, list)):
            seq = value if isinstance(value, list) else [value]
            arr = np.array([s.encode() if isinstance(s, str) else s for s in seq], dtype=np.object_)
            wire = "BYTES"
        else:
            wire, np_type = ("UINT64", np.uint64) if name in ("seed", "random_seed") else _WIRE[type(value)]
            arr = np.array([value], dtype=np_type)
        tensor = grpcclient.InferInput(name, list(arr.shape), wire)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


@dataclass
class Record:
    """Everything one request id received."""
    sent_at: float = 0.0
    num_sent: int = 0  # >1 only when a test reuses an id on purpose
    num_responses: int = 0
    num_finals: int = 0
    num_output_tokens: int = 0
    chunks: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    first_response_at: float | None = None
    final_at: float | None = None

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")

    @property
    def error(self) -> str | None:
        return self.errors[-1] if self.errors else None


class StreamClient:
    """One gRPC stream; any number of requests on it, told apart by request id."""

    def __init__(self, url: str, anonymous_errors: bool = False):
        self.anonymous_errors = anonymous_errors
        self.client = grpcclient.InferenceServerClient(url)
        self.records: dict[str, Record] = {}
        self.unmatched_errors: list[str] = []  # errors whose request id could not be found
        self.unknown_responses = 0  # responses for an id never sent
        self._cond = threading.Condition()
        self._closed = False
        self.client.start_stream(callback=self._on_response)

    # -- callback (gRPC thread) ------------------------------------------------------------------
    def _on_response(self, result=None, error=None) -> None:
        now = time.monotonic()
        with self._cond:
            if result is None:
                self._on_error(error.message() if hasattr(error, "message") else str(error), now)
            else:
                self._on_result(result, now)
            self._cond.notify_all()

    def _on_error(self, message: str, now: float) -> None:
        m = _ERROR_ID.search(message or "")
        rid = (m.group(1) if m.group(1) is not None else m.group(2)) if m else None
        if rid is None and self.anonymous_errors and not (message or "").startswith("[StatusCode."):
            open_ids = [k for k, r in self.records.items() if r.num_finals < r.num_sent]
            rid = open_ids[0] if len(open_ids) == 1 else None
        rec = self.records.get(rid) if rid is not None else None
        if rec is None:
            self.unmatched_errors.append(message)
            return
        rec.errors.append(message)
        rec.num_finals += 1
        rec.final_at = now

    def _on_result(self, result, now: float) -> None:
        response = result.get_response()
        rec = self.records.get(response.id)
        if rec is None:
            self.unknown_responses += 1
            return
        rec.num_responses += 1
        if rec.first_response_at is None:
            rec.first_response_at = now
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            rec.chunks.append(text.reshape(-1)[0])
        n = result.as_numpy("num_output_tokens")
        if n is not None:
            rec.num_output_tokens += int(n.reshape(-1)[0])
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.reshape(-1)[0] != b"None":  # "None" until the last response (vLLM)
            rec.finish_reasons.append(reason.reshape(-1)[0].decode())
        params = response.parameters
        if "triton_final_response" in params and params["triton_final_response"].bool_param:
            rec.num_finals += 1
            rec.final_at = now

    # -- requests --------------------------------------------------------------------------------
    def send(self, model: str, request_id: str, prompt: Any, values: dict[str, Any] | None = None,
             parameters: dict[str, Any] | None = None) -> None:
        with self._cond:
            rec = self.records.setdefault(request_id, Record())
            rec.num_sent += 1
            rec.sent_at = time.monotonic()
        self.client.async_stream_infer(model, make_inputs(prompt, values or {}), request_id=request_id,
                                       parameters=parameters)

    def wait_finals(self, timeout_s: float = 60.0, ids: list[str] | None = None) -> bool:
        """Until every (given) request has as many finals as it was sent; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                pending = [k for k in (ids or self.records) if self.records[k].num_finals < self.records[k].num_sent]
                if not pending:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))

    def wait_responses(self, request_id: str, count: int, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.records[request_id].num_responses + self.records[request_id].num_finals < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def final_counts(self) -> dict[str, tuple[int, int]]:
        """request id -> (times sent, finals received)."""
        with self._cond:
            return {k: (r.num_sent, r.num_finals) for k, r in self.records.items()}

    def close(self, cancel: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


def finals_problems(clients: list[StreamClient], linger_s: float = 0.3) -> list[str]:
    """After a short linger (a duplicate final would arrive late), every request id with finals != sends."""
    time.sleep(linger_s)
    problems = []
    for c in clients:
        for rid, (sent, finals) in c.final_counts().items():
            if finals != sent:
                problems.append(f"{rid}: sent {sent}, finals {finals}")
        problems += [f"unmatched error: {m}" for m in c.unmatched_errors]
        if c.unknown_responses:
            problems.append(f"{c.unknown_responses} response(s) for ids never sent")
    return problems
