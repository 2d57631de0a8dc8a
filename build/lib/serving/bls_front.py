"""TensorRT-LLM's way in to the same engine: models `ensemble` (decoupled: streams) and `ensemble_unary`
(one response per request, for plain `infer` clients). Each batch row becomes one request to the in-flight
model `llm` through BLS, and its responses come back with TensorRT-LLM's shapes (serving.batch_rows).
Importable only inside Triton's python-backend stub.

BLS in Triton 2.51 cannot cancel a call, so a client that gives up is honoured the TensorRT-LLM way: a
`stop=true` request with the same request id, which `llm` turns into cancelling that request.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from inflight.fields import InvalidRequestError

from .batch_rows import row_outputs, split_rows, stack_rows, with_trtllm_defaults
from .contract import OUTPUTS
from .errors import INTERNAL, INVALID_ARG, RequestError
from .triton_glue import IPC_LOCK, error_response, read_inputs

log = logging.getLogger(__name__)
TARGET = "llm"
_LLM_OUTPUTS = [name for name, _ in OUTPUTS]


class _Row:
    """One batch row's call to `llm`: its BLS request id, and the responses it got back."""

    def __init__(self, index: int, inputs: dict[str, np.ndarray], call_id: str, parameters: dict):
        self.index = index
        self.inputs = inputs
        self.call_id = call_id
        self.parameters = parameters
        self.error: str | None = None
        self.last: dict[str, np.ndarray] | None = None  # the latest response, held back (it may be the last)

    def call(self):
        tensors = [pb_utils.Tensor(name, array) for name, array in self.inputs.items()]
        request = pb_utils.InferenceRequest(model_name=TARGET, inputs=tensors, requested_output_names=_LLM_OUTPUTS,
                                            request_id=self.call_id, parameters=self.parameters)
        return request.exec(decoupled=True)


def _outputs_of(response) -> dict[str, np.ndarray]:
    found = {}
    for name in _LLM_OUTPUTS:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


def _cancel(row: _Row) -> None:
    """TensorRT-LLM's cancel: stop=true under the running call's request id."""
    stop = pb_utils.InferenceRequest(model_name=TARGET, inputs=[pb_utils.Tensor(
        "text_input", np.array([b""], dtype=np.object_))], requested_output_names=["text_output"],
        request_id=row.call_id, parameters={"stop": True})
    for _ in stop.exec(decoupled=True):
        pass


class BlsFront:
    """Serves TensorRT-LLM-shaped requests through `llm`. decoupled: each row's responses stream back with
    their batch_index, the FINAL flag on the very last; otherwise the rows' whole outputs, stacked."""

    def __init__(self, model_config: dict):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        self.input_names = [i["name"] for i in model_config["input"]]
        self._ids = itertools.count()

    def execute(self, requests) -> list | None:
        if not self.decoupled:
            return [self._unary(request) for request in requests]
        for request in requests:
            sender = request.get_response_sender()
            try:
                rows = self._rows(request)
            except (InvalidRequestError, ValueError) as e:
                self._send(sender, None, final=True, error=RequestError(str(e), INVALID_ARG))
                continue
            threading.Thread(target=self._stream, args=(sender, rows), daemon=True,
                             name=f"bls-{rows[0].call_id}").start()
        return None

    def _rows(self, request) -> list[_Row]:
        inputs, parameters = read_inputs(request, self.input_names)
        client_id = request.request_id() or "request"
        return [_Row(b, with_trtllm_defaults(row, parameters), f"{client_id}/bls{next(self._ids)}", parameters)
                for b, row in enumerate(split_rows(inputs))]

    # ---- decoupled --------------------------------------------------------------------------------
    def _stream(self, sender, rows: list[_Row]) -> None:
        remaining = [len(rows)]
        lock = threading.Lock()
        threads = [threading.Thread(target=self._stream_row, args=(sender, row, rows, remaining, lock), daemon=True)
                   for row in rows]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _stream_row(self, sender, row: _Row, rows: list[_Row], remaining: list[int], lock: threading.Lock) -> None:
        cancelled = False
        try:
            for response in row.call():
                if response.has_error():
                    row.error = response.error().message()
                    break
                if row.last is not None:
                    self._send(sender, row_outputs(row.last, row.index), final=False)
                row.last = _outputs_of(response)
                if not cancelled and self._is_cancelled(sender):
                    cancelled = True
                    _cancel(row)
        except Exception as e:  # noqa: BLE001 - this row fails, the request still ends exactly once
            log.exception("BLS call to %s failed", TARGET)
            row.error = f"internal error: {type(e).__name__}: {e}"
        # The FINAL flag goes on the very last response of the request: a row that ends while others still run
        # sends its held response under the lock, before counting itself out, so none can follow the final.
        with lock:
            last_row = remaining[0] == 1
            error = next((r.error for r in rows if r.error), None) if last_row else None
            if row.last is not None:
                self._send(sender, row_outputs(row.last, row.index), final=last_row and error is None)
            elif last_row and error is None:
                error = "the engine ended a row without a response"
            if last_row and error is not None:  # a batch row's error ends the whole request, once
                code = INVALID_ARG if "allowed" in error and "internal error" not in error else INTERNAL
                self._send(sender, None, final=True, error=RequestError(error, code))
            remaining[0] -= 1

    @staticmethod
    def _send(sender, outputs: dict[str, np.ndarray] | None, final: bool, error: RequestError | None = None) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        response = error_response(error) if error is not None else pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])
        with IPC_LOCK:
            sender.send(response, flags=flags)

    @staticmethod
    def _is_cancelled(sender) -> bool:
        with IPC_LOCK:
            return sender.is_cancelled()

    # ---- unary ------------------------------------------------------------------------------------
    def _unary(self, request) -> Any:
        try:
            rows = self._rows(request)
            if any(bool(np.asarray(r.inputs.get(n, [False])).reshape(-1)[0]) for r in rows
                   for n in ("stream", "streaming")):
                raise InvalidRequestError("stream=True is not allowed on a non-decoupled model: allowed false "
                                          "(use the decoupled model `ensemble` to stream)")
        except (InvalidRequestError, ValueError) as e:
            return error_response(RequestError(str(e), INVALID_ARG))
        threads = [threading.Thread(target=self._collect_row, args=(row,), daemon=True) for row in rows]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = next((r for r in rows if r.error or r.last is None), None)
        if failed is not None:
            return error_response(RequestError(failed.error or "no response from the engine", INVALID_ARG
                                               if failed.error and "allowed" in failed.error else INTERNAL))
        stacked = stack_rows([{k: v for k, v in row_outputs(r.last, r.index).items()
                               if k not in ("batch_index", "sequence_index")} for r in rows])
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in stacked.items()])

    @staticmethod
    def _collect_row(row: _Row) -> None:
        try:
            for response in row.call():  # not streaming: one response, the whole output
                if response.has_error():
                    row.error = response.error().message()
                    return
                row.last = _outputs_of(response)
        except Exception as e:  # noqa: BLE001 - reported as this request's error
            log.exception("BLS call to %s failed", TARGET)
            row.error = f"internal error: {type(e).__name__}: {e}"


def call_llm(inputs: dict[str, np.ndarray], call_id: str) -> dict[str, np.ndarray]:
    """One non-streaming request to `llm`, its whole answer; InvalidRequestError with its message on a refusal."""
    row = _Row(0, inputs, call_id, {})
    BlsFront._collect_row(row)
    if row.error or row.last is None:
        raise InvalidRequestError(row.error or "no response from the engine")
    return row.last
