"""The request contract: one request's input tensors and request parameters -> a ParsedRequest.

Accepts the union of the vLLM-backend and TensorRT-LLM-ensemble conventions, field by field as
inflight.fields.FIELDS declares them. Free of pb_utils so both Triton arms (and unit tests) share it.
Every refusal is an InvalidRequestError that names the field, the offending value and what is allowed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from inflight.fields import (BY_NAME, FIELDS, SAMPLING_FIELDS, InvalidRequestError, RequestLimits, Shown, input_tensors,
                             refuse)
from inflight.sequence import SamplingParams

# Tensor inputs a model may declare (what Triton lets through). `stop` is deliberately absent: vLLM clients
# send stop text there and TensorRT-LLM clients a cancel flag, so it is a request parameter only.
INPUT_NAMES = ("text_input", "sampling_parameters", *(name for name, _, _ in input_tensors()))
# Names allowed as keys of the sampling_parameters JSON and as request parameters: every field, every alias.
KEY_NAMES = tuple(sorted(BY_NAME))

# What a response may carry: (name, Triton type). Optional ones only when the request asked for them. Each has
# one element per sample of the request (n), so a vLLM client reads output[i] for sample i; output_log_probs
# is [samples, tokens] (OUTPUT_DIMS).
OUTPUTS = (("text_output", "TYPE_STRING"), ("finish_reason", "TYPE_STRING"), ("num_input_tokens", "TYPE_UINT32"),
           ("num_output_tokens", "TYPE_UINT32"), ("cumulative_logprob", "TYPE_FP32"), ("logprobs", "TYPE_STRING"),
           ("cum_log_probs", "TYPE_FP32"), ("output_log_probs", "TYPE_FP32"), ("output_ids", "TYPE_INT32"),
           ("num_cached_tokens", "TYPE_UINT32"))
OUTPUT_DIMS = {"output_log_probs": [-1, -1]}  # the rest: [-1]


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    # Serving flags: the non-sampling rows of inflight.fields.FIELDS, with their defaults.
    stream: bool = False
    exclude_input_in_output: bool = True
    apply_chat_template: bool = False
    priority: int = 0
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_num_cached_tokens: bool = False
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    return_log_probs: bool = False
    return_output_ids: bool = False
    pad_id: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    cancel: bool = False  # TensorRT-LLM's stop=true: cancel the in-flight request(s) with this request id
    # The client set `logprobs` itself. When it did not, a log-probability output still needs the sampled
    # tokens' logprobs (params.logprobs = 0), but vLLM's `logprobs` output says null.
    logprobs_requested: bool = False

    @property
    def wants_token_logprobs(self) -> bool:
        return self.return_cumulative_logprob or self.return_log_probs or self.return_logprobs


# ---- extracting raw values from the three sources --------------------------------------------

def _shape(array: np.ndarray) -> Shown:
    return Shown(f"<{array.dtype} tensor of shape {list(array.shape)}>")


def _tensor_value(name: str, array: Any) -> Any:
    """One element for scalar fields, a flat list for list fields; BYTES elements stay bytes."""
    array = np.asarray(array)
    if BY_NAME[name].dims == [-1]:
        return [x.item() if isinstance(x, np.generic) else x for x in array.reshape(-1)]
    if array.size != 1:
        raise refuse(name, _shape(array), "exactly one element")
    return array.reshape(-1)[0]


def _single_bytes(name: str, array: Any) -> bytes | str:
    """The one element of a BYTES tensor that must hold exactly one (text_input, sampling_parameters)."""
    array = np.asarray(array)
    if array.dtype != np.object_ and array.dtype.kind not in ("S", "U"):
        raise refuse(name, _shape(array), "a BYTES (string) tensor")
    if array.size != 1:
        raise refuse(name, _shape(array), "exactly one element (shape [1])")
    raw = array.reshape(-1)[0]
    if isinstance(raw, np.generic):
        raw = raw.item()
    if not isinstance(raw, (bytes, str)):
        raise refuse(name, raw, "a BYTES (string) tensor")
    return raw


def _parse_sampling_json(array: Any, limits: RequestLimits) -> dict[str, Any]:
    raw = _single_bytes("sampling_parameters", array)
    if len(raw) > limits.max_json_bytes:
        raise refuse("sampling_parameters", Shown(f"<{len(raw)} bytes>"),
                     f"at most {limits.max_json_bytes} bytes of JSON")
    shown = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise refuse("sampling_parameters", shown, f"a JSON object ({e})") from None
    if not isinstance(obj, dict):
        raise refuse("sampling_parameters", shown, "a JSON object")
    unknown = sorted(k for k in obj if k not in BY_NAME)
    if unknown:
        raise InvalidRequestError(f"sampling_parameters key {unknown[0]!r} is unknown: allowed keys are "
                                  f"{', '.join(KEY_NAMES)}")
    return obj


def _parse_prompt(inputs: Mapping[str, Any], required: bool) -> str:
    """Present, one BYTES element, UTF-8. Emptiness and length are the engine's to judge (inflight.prompt)."""
    if inputs.get("text_input") is None:
        if required:
            raise InvalidRequestError("text_input is missing: allowed a BYTES tensor of shape [1] holding the prompt")
        return ""
    raw = _single_bytes("text_input", inputs["text_input"])
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse("text_input", raw, "UTF-8 text") from None


def parse_request(inputs: Mapping[str, Any], parameters: Mapping[str, Any] | None = None,
                  limits: RequestLimits = RequestLimits(), defaults: Mapping[str, Any] | None = None) -> ParsedRequest:
    """Parse one request. `inputs`: tensor name -> numpy array (absent inputs simply missing);
    `parameters`: the request parameters (json.loads of request.parameters()); `defaults`: serving flags' values
    when the request does not set them (the model's own defaults, e.g. exclude_input_in_output).

    A field given in several places (an input tensor, a request parameter, a key of
    sampling_parameters, or under two aliases) must carry the same value everywhere."""
    parameters = dict(parameters or {})
    unknown_inputs = sorted(n for n in inputs if n not in INPUT_NAMES)
    if unknown_inputs:
        raise InvalidRequestError(f"input {unknown_inputs[0]!r} is unknown: "
                                  f"allowed inputs are {', '.join(INPUT_NAMES)}")

    # `stop` as a request parameter: a bool is TensorRT-LLM's cancel flag, text is vLLM's stop words.
    cancel = False
    if isinstance(parameters.get("stop"), bool):
        cancel = parameters.pop("stop")
    unknown_params = sorted(k for k in parameters if k not in BY_NAME)
    if unknown_params:
        raise InvalidRequestError(f"request parameter {unknown_params[0]!r} is unknown: allowed parameters are "
                                  f"{', '.join(KEY_NAMES)}")

    prompt = _parse_prompt(inputs, required=not cancel)

    sources: list[tuple[str, Mapping[str, Any]]] = []
    if inputs.get("sampling_parameters") is not None:
        sources.append(("sampling_parameters key", _parse_sampling_json(inputs["sampling_parameters"], limits)))
    sources.append(("request parameter", parameters))
    sources.append(("input", {n: _tensor_value(n, a) for n, a in inputs.items()
                              if n not in ("text_input", "sampling_parameters") and a is not None}))

    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for where, raw_values in sources:
        for name, raw in raw_values.items():
            f = BY_NAME[name]
            value = f.parse(raw, name, limits)
            if f.name in values and values[f.name] != value:
                raise InvalidRequestError(
                    f"{name}={value!r} ({where}) conflicts with {origin[f.name]}: give one value")
            values[f.name] = value
            origin[f.name] = f"{name}={value!r} ({where})"

    if values.get("stream") and values.get("exclude_input_in_output") is False:
        # vLLM's backend refuses this too: a stream never repeats the prompt, so asking for it is a mistake.
        raise InvalidRequestError("exclude_input_in_output=False is not allowed when streaming: a stream never "
                                  "repeats the prompt; allowed true, or stream=false")
    flags = {**(defaults or {}), **{f.name: values[f.name] for f in FIELDS if not f.sampling and f.name in values}}
    req = ParsedRequest(prompt=prompt, cancel=cancel, logprobs_requested="logprobs" in values, **flags)
    sampling = {f.name: values[f.name] for f in SAMPLING_FIELDS if f.name in values}
    if req.wants_token_logprobs and sampling.get("logprobs") is None:
        sampling["logprobs"] = 0  # the sampled tokens' own logprobs, no alternatives
    req.params = SamplingParams(**sampling)
    return req
