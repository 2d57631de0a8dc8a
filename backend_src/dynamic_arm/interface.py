"""The internal interface between the ensemble's steps (preprocessing -> llm_dynamic -> postprocessing).

preprocessing parses the public contract once (serving.contract) and tokenizes; llm_dynamic receives
  input_ids       INT32 [-1]  the prompt's token ids (ragged across a batch)
  request_config  BYTES [1]   JSON: {"params": {SamplingParams fields}, the ParsedRequest flags, "arrival_unix"
                              (when preprocessing saw it, for TTFT), "prompt" (only when it must be echoed)}
and answers every response with the public outputs (serving.lifecycle.Responder, the same code as `llm`) plus
  output_ids      INT32 [-1]  the token ids this response carries (all of them when not streaming)
  row_key         BYTES [1]   the row's random key: postprocessing posts it when the client cancels the
                              ensemble (cancel_relay.py)
postprocessing checks the two agree and passes the public outputs on. JSON keeps every sampling field,
including the list-valued ones (stop, bad_words), in one tensor, validated again on arrival.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from inflight.fields import SERVING_FIELDS, InvalidRequestError
from inflight.sequence import SamplingParams
from serving.contract import ParsedRequest

_FLAGS = tuple(f.name for f in SERVING_FIELDS)
_PARAM_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))


def encode_request(req: ParsedRequest, arrival_unix: float | None = None) -> bytes:
    body = {"params": dataclasses.asdict(req.params), **{name: getattr(req, name) for name in _FLAGS},
            "logprobs_requested": req.logprobs_requested,
            "arrival_unix": time.time() if arrival_unix is None else arrival_unix}
    if not req.exclude_input_in_output:
        body["prompt"] = req.prompt
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def decode_request(raw: bytes | str) -> tuple[ParsedRequest, float | None]:
    """The inverse of encode_request: the request and its arrival as a time.monotonic() value (None when
    unknown). Raises InvalidRequestError for anything preprocessing would not send."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"request_config is not JSON ({e}): allowed what preprocessing emits") from None
    if not isinstance(body, dict) or not isinstance(body.get("params"), dict):
        raise InvalidRequestError(f"request_config={str(raw)[:80]!r} is malformed: allowed a JSON object with 'params'")
    unknown = sorted(set(body["params"]) - set(_PARAM_NAMES))
    if unknown:
        raise InvalidRequestError(f"request_config params key {unknown[0]!r} is unknown: "
                                  f"allowed {', '.join(_PARAM_NAMES)}")
    try:
        params = SamplingParams(**body["params"])
    except TypeError as e:
        raise InvalidRequestError(f"request_config params are malformed: {e}") from None
    flags = {name: body[name] for name in (*_FLAGS, "logprobs_requested") if name in body}
    arrival = body.get("arrival_unix")
    # Wall clock across processes, then onto this process's monotonic clock (what the engine measures with).
    arrival_mono = time.monotonic() - max(0.0, time.time() - arrival) if isinstance(arrival, (int, float)) else None
    return ParsedRequest(prompt=body.get("prompt", ""), params=params, **flags), arrival_mono


_PUBLIC = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob",
           "num_cached_tokens")


def to_public_outputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """postprocessing: one llm_dynamic response (tensors with a leading batch dim of 1) -> the public
    outputs with `llm`'s shapes. Raises ValueError when the response breaks the interface."""
    raw = np.asarray(inputs["text_output"]).reshape(-1)
    if raw.size < 1:
        raise ValueError("text_output has no element: allowed one per sample")
    texts = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in raw]
    for text in texts:
        text.decode("utf-8")  # UnicodeDecodeError is a ValueError: the engine never splits a character
    outputs = {"text_output": np.array(texts, dtype=np.object_)}
    num_ids = np.asarray(inputs["output_ids"]).size
    for name in _PUBLIC[1:]:
        if inputs.get(name) is not None:
            outputs[name] = np.asarray(inputs[name]).reshape(-1)
    if "num_output_tokens" in outputs and int(outputs["num_output_tokens"].sum()) != num_ids:
        raise ValueError(f"num_output_tokens={outputs['num_output_tokens'].tolist()} but the response carries "
                         f"{num_ids} output_ids: allowed equal counts")
    return outputs
