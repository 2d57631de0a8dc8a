"""The request contract: turn one request's input tensors and request parameters into a ParsedRequest.

Accepts the union of the vLLM-backend and TensorRT-LLM-ensemble conventions. Free of pb_utils so
both Triton arms (and unit tests) share it. Every refusal is an InvalidRequestError that names the
field, the offending value and what is allowed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from inflight.sequence import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class ContractLimits:
    """Abuse caps, checked before anything is tokenized."""
    max_prompt_bytes: int = 1 << 20
    max_json_bytes: int = 64 << 10
    max_stop_words: int = 32  # stop and bad words, each list
    max_word_bytes: int = 1024  # one stop or bad word
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes", "max_json_bytes", "max_stop_words", "max_word_bytes", "max_stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is out of range: allowed an integer >= 1")


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = True
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    priority: int = 0
    cancel: bool = False  # TensorRT-LLM's stop=true: cancel the in-flight request(s) with this request id


# ---- value conversion: (value, field) -> canonical Python value, or InvalidRequestError -----------

def _bad(name: str, value: Any, allowed: str) -> InvalidRequestError:
    """`value` is shown with repr (cut at 80 characters); a _Described value is shown as it is."""
    if isinstance(value, _Described):
        shown = str(value)
    else:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
    return InvalidRequestError(f"{name}={shown} is invalid: allowed {allowed}")


class _Described(str):
    """A stand-in for a value too big or too structured to echo back (a tensor shape, a byte count)."""


def _shape(array: np.ndarray) -> _Described:
    return _Described(f"<{array.dtype} tensor of shape {list(array.shape)}>")


def _as_text(name: str, value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(name, value, "UTF-8 text") from None
    return value


def _to_int(name: str, value: Any, lo: int, hi: int, allowed: str) -> int:
    value = _as_text(name, value)
    if isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, allowed)
    if isinstance(value, (int, np.integer)):
        result = int(value)
    elif isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        result = int(value)
    elif isinstance(value, str):
        try:
            result = int(value.strip())
        except ValueError:
            raise _bad(name, value, allowed) from None
    else:
        raise _bad(name, value, allowed)
    if not lo <= result <= hi:
        raise _bad(name, value, allowed)
    return result


def _to_float(name: str, value: Any, allowed: str) -> float:
    value = _as_text(name, value)
    if isinstance(value, (bool, np.bool_)):
        raise _bad(name, value, allowed)
    if isinstance(value, (int, float, np.integer, np.floating)):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            raise _bad(name, value, allowed) from None
    else:
        raise _bad(name, value, allowed)
    if not math.isfinite(result):
        raise _bad(name, value, allowed)
    return result


def _to_bool(name: str, value: Any) -> bool:
    value = _as_text(name, value)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and int(value) in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise _bad(name, value, "a boolean (true/false, 1/0)")


def _to_words(name: str, value: Any, limits: ContractLimits) -> list[str]:
    value = _as_text(name, value)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _bad(name, value, "a string or a list of strings")
    if len(value) > limits.max_stop_words:
        raise _bad(name, _Described(f"<{len(value)} words>"), f"at most {limits.max_stop_words} words")
    words = []
    for item in value:
        item = _as_text(name, item)
        if not isinstance(item, str) or not item:
            raise _bad(name, item, "non-empty strings")
        if len(item.encode("utf-8")) > limits.max_word_bytes:
            raise _bad(name, item, f"words of at most {limits.max_word_bytes} bytes")
        words.append(item)
    return words


def _to_token_ids(name: str, value: Any, limits: ContractLimits) -> list[int]:
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) > limits.max_stop_token_ids:
        raise _bad(name, _Described(f"<{len(value)} ids>"), f"at most {limits.max_stop_token_ids} token ids")
    return [_to_int(name, v, 0, 2**31 - 1, "a list of token ids >= 0") for v in value]


_I32 = (-(2**31), 2**31 - 1)


def _int_field(lo: int, hi: int, allowed: str) -> Callable[[str, Any, ContractLimits], int]:
    return lambda name, v, limits: _to_int(name, v, lo, hi, allowed)


def _float_field(name: str, v: Any, limits: ContractLimits) -> float:
    return _to_float(name, v, "a number")


def _bool_field(name: str, v: Any, limits: ContractLimits) -> bool:
    return _to_bool(name, v)


# canonical field -> (converter, aliases). Range checks beyond the type live in SamplingParams,
# so the engine and every front end agree on them.
FIELDS: dict[str, tuple[Callable[[str, Any, ContractLimits], Any], tuple[str, ...]]] = {
    "max_tokens": (_int_field(1, 2**31 - 1, "an integer >= 1"), ("request_output_len",)),
    "min_tokens": (_int_field(0, 2**31 - 1, "an integer >= 0"), ("min_length",)),
    "temperature": (_float_field, ()),
    "top_p": (_float_field, ("runtime_top_p",)),
    "top_k": (_int_field(-1, 2**31 - 1, "an integer >= -1 (-1 or 0: no limit)"), ("runtime_top_k",)),
    "min_p": (_float_field, ()),
    "seed": (_int_field(0, 2**64 - 1, "an integer in [0, 2^64)"), ("random_seed",)),
    "repetition_penalty": (_float_field, ()),
    "presence_penalty": (_float_field, ()),
    "frequency_penalty": (_float_field, ()),
    "stop": (_to_words, ("stop_words",)),
    "bad_words": (_to_words, ()),
    "stop_token_ids": (_to_token_ids, ()),
    "ignore_eos": (_bool_field, ()),
    "skip_special_tokens": (_bool_field, ()),
    "stream": (_bool_field, ("streaming",)),
    "exclude_input_in_output": (_bool_field, ()),
    "priority": (_int_field(*_I32, "a 32-bit integer"), ()),
    "return_finish_reason": (_bool_field, ()),
    "return_num_input_tokens": (_bool_field, ()),
    "return_num_output_tokens": (_bool_field, ()),
    "return_logprobs": (_bool_field, ("logprobs",)),
}
_CANONICAL = {alias: canon for canon, (_, aliases) in FIELDS.items() for alias in (canon, *aliases)}
SAMPLING_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "bad_words",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens")
LIST_FIELDS = ("stop", "bad_words", "stop_token_ids")

# Tensor inputs a model may declare (what Triton lets through). `stop` is deliberately absent: vLLM
# clients send stop text there and TensorRT-LLM clients a cancel flag, so it is a request parameter.
INPUT_NAMES = ("text_input", "sampling_parameters", "stream", "streaming", "max_tokens", "request_output_len",
               "min_tokens", "min_length", "temperature", "top_p", "runtime_top_p", "top_k", "runtime_top_k",
               "seed", "random_seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "stop_words", "bad_words", "ignore_eos", "exclude_input_in_output", "priority",
               "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens", "return_logprobs")
# Keys allowed inside the sampling_parameters JSON and as request parameters.
KEY_NAMES = tuple(sorted(_CANONICAL))


# ---- extracting raw values from the three sources --------------------------------------------

def _tensor_value(name: str, array: Any) -> Any:
    """One element for scalar fields, a flat list for list fields; BYTES elements stay bytes."""
    array = np.asarray(array)
    canon = _CANONICAL[name]
    if canon in LIST_FIELDS:
        return [x.item() if isinstance(x, np.generic) else x for x in array.reshape(-1)]
    if array.size != 1:
        raise _bad(name, _shape(array), "exactly one element")
    item = array.reshape(-1)[0]
    return item.item() if isinstance(item, np.generic) and not isinstance(item, np.bytes_) else item


def _shown_text(raw: bytes | str) -> str:
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw


def _parse_sampling_json(array: Any, limits: ContractLimits) -> dict[str, Any]:
    array = np.asarray(array)
    if array.size != 1:
        raise _bad("sampling_parameters", _shape(array), "exactly one JSON string")
    raw = array.reshape(-1)[0]
    if isinstance(raw, np.generic):
        raw = raw.item()
    if not isinstance(raw, (bytes, str)):
        raise _bad("sampling_parameters", raw, "a JSON object as a BYTES/string element")
    if len(raw) > limits.max_json_bytes:
        raise _bad("sampling_parameters", _Described(f"<{len(raw)} bytes>"),
                   f"at most {limits.max_json_bytes} bytes of JSON")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad("sampling_parameters", _shown_text(raw), f"a JSON object ({e})") from None
    if not isinstance(obj, dict):
        raise _bad("sampling_parameters", _shown_text(raw), "a JSON object")
    unknown = sorted(k for k in obj if k not in _CANONICAL)
    if unknown:
        raise InvalidRequestError(f"sampling_parameters key {unknown[0]!r} is unknown: allowed keys are "
                                  f"{', '.join(KEY_NAMES)}")
    return obj


def _parse_prompt(inputs: Mapping[str, Any], limits: ContractLimits, required: bool) -> str:
    if "text_input" not in inputs or inputs["text_input"] is None:
        if required:
            raise InvalidRequestError("text_input is missing: allowed a BYTES tensor of shape [1] holding the prompt")
        return ""
    array = np.asarray(inputs["text_input"])
    if array.dtype != np.object_ and array.dtype.kind not in ("S", "U"):
        raise _bad("text_input", _shape(array), "a BYTES (string) tensor")
    if array.size != 1:
        raise _bad("text_input", _shape(array), "exactly one prompt (shape [1])")
    raw = array.reshape(-1)[0]
    if isinstance(raw, np.generic):
        raw = raw.item()
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if not isinstance(raw, bytes):
        raise _bad("text_input", raw, "a BYTES (string) tensor")
    if len(raw) > limits.max_prompt_bytes:
        raise _bad("text_input", _Described(f"<{len(raw)} bytes>"),
                   f"a prompt of at most {limits.max_prompt_bytes} bytes")
    try:
        prompt = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad("text_input", raw, "UTF-8 text") from None
    if required and not prompt:
        raise InvalidRequestError("text_input='' is empty: allowed a non-empty prompt")
    return prompt


def parse_request(inputs: Mapping[str, Any], parameters: Mapping[str, Any] | None = None,
                  limits: ContractLimits = ContractLimits()) -> ParsedRequest:
    """Parse one request. `inputs`: tensor name -> numpy array (absent inputs simply missing);
    `parameters`: the request parameters (json.loads of request.parameters()).

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
    unknown_params = sorted(k for k in parameters if k not in _CANONICAL)
    if unknown_params:
        raise InvalidRequestError(f"request parameter {unknown_params[0]!r} is unknown: allowed parameters are "
                                  f"{', '.join(KEY_NAMES)}")

    prompt = _parse_prompt(inputs, limits, required=not cancel)

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
            canon = _CANONICAL[name]
            convert, _ = FIELDS[canon]
            value = convert(name, raw, limits)
            if canon in values and values[canon] != value:
                raise InvalidRequestError(
                    f"{name}={value!r} ({where}) conflicts with {origin[canon]}: give one value")
            values[canon] = value
            origin[canon] = f"{name}={value!r} ({where})"

    sampling = {k: values[k] for k in SAMPLING_FIELDS if k in values}
    return_logprobs = values.get("return_logprobs", False)
    params = SamplingParams(**sampling, logprobs=return_logprobs)  # validates ranges
    return ParsedRequest(
        prompt=prompt,
        params=params,
        stream=values.get("stream", False),
        exclude_input_in_output=values.get("exclude_input_in_output", True),
        return_finish_reason=values.get("return_finish_reason", False),
        return_num_input_tokens=values.get("return_num_input_tokens", False),
        return_num_output_tokens=values.get("return_num_output_tokens", False),
        return_logprobs=return_logprobs,
        priority=values.get("priority", 0),
        cancel=cancel,
    )
