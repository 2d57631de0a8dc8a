"""The internal interface between the ensemble's steps (preprocessing -> llm_dynamic -> postprocessing).

preprocessing parses the public contract once (serving.contract) and tokenizes; llm_dynamic receives
  input_ids       INT32 [-1]  the prompt's token ids (ragged across a batch)
  request_config  BYTES [1]   JSON: {"params": {SamplingParams fields}, "stream", "exclude_input_in_output",
                              "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                              "return_logprobs", "priority", "prompt" (only when the prompt must be echoed)}
and answers every response with
  output_ids      INT32 [-1]  the token ids this response carries (all of them when not streaming)
  text_delta      BYTES [1]   the engine's incremental text for them (prompt first when echoed)
  finish_reason, num_input_tokens, num_output_tokens, cumulative_logprob: the contract's optional outputs,
                              present only when asked for (finish_reason only on the final response).
postprocessing maps that onto the public outputs (text_output ...). JSON keeps every sampling field,
including the list-valued ones (stop, bad_words), in one tensor, validated again on arrival.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from inflight.sequence import InvalidRequestError, SamplingParams
from serving.contract import ParsedRequest

_FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
          "return_num_output_tokens", "return_logprobs", "priority")
_PARAM_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))


def encode_request(req: ParsedRequest) -> bytes:
    body = {"params": dataclasses.asdict(req.params), **{name: getattr(req, name) for name in _FLAGS}}
    if not req.exclude_input_in_output:
        body["prompt"] = req.prompt
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def decode_request(raw: bytes | str) -> ParsedRequest:
    """The inverse of encode_request; raises InvalidRequestError for anything preprocessing would not send."""
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
    flags = {name: body[name] for name in _FLAGS if name in body}
    return ParsedRequest(prompt=body.get("prompt", ""), params=params, **flags)


_PASSED_THROUGH = ("finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob")


def to_public_outputs(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """postprocessing: one llm_dynamic response (tensors with a leading batch dim of 1) -> the public
    outputs with `llm`'s shapes. Raises ValueError when the response breaks the interface."""
    raw = np.asarray(inputs["text_delta"]).reshape(-1)
    if raw.size != 1:
        raise ValueError(f"text_delta has {raw.size} elements: allowed exactly 1")
    text = raw[0].encode("utf-8") if isinstance(raw[0], str) else bytes(raw[0])
    text.decode("utf-8")  # UnicodeDecodeError is a ValueError: the engine never splits a character
    outputs = {"text_output": np.array([text], dtype=np.object_)}
    num_ids = np.asarray(inputs["output_ids"]).size
    for name in _PASSED_THROUGH:
        if inputs.get(name) is not None:
            outputs[name] = np.asarray(inputs[name]).reshape(-1)
    if "num_output_tokens" in outputs and int(outputs["num_output_tokens"][0]) != num_ids:
        raise ValueError(f"num_output_tokens={int(outputs['num_output_tokens'][0])} but the response carries "
                         f"{num_ids} output_ids: allowed equal counts")
    return outputs
