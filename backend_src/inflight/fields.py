"""The request schema: every field a request may carry, in one table (FIELDS).

Each Field says its name and the aliases other clients send it under (vLLM backend, TensorRT-LLM ensemble),
its kind, default and allowed range, whether it may arrive as an input tensor, and its OpenAI name. From this
table come SamplingParams (the engine's record of how a request samples), the Triton contract parser
(serving.contract), the OpenAI mapping, and the `input` section of the llm model's config.pbtxt
(scripts/gen_configs.py). Adding a sampling field is one row here, plus the sampler code that uses it.

Every refusal is an InvalidRequestError whose message names the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the field, the value and the allowed range."""


# Field kinds, and the Triton data type an input tensor of each kind is declared with.
INT, FLOAT, BOOL, WORDS, TOKEN_IDS, FLOATS = "int", "float", "bool", "words", "token_ids", "floats"
# TEXT: one string (a guide, a choice among names); OBJECT: a JSON object, given as one or as its JSON text.
TEXT, OBJECT = "text", "object"
_TRITON_TYPES = {INT: "TYPE_INT32", FLOAT: "TYPE_FP32", BOOL: "TYPE_BOOL", WORDS: "TYPE_STRING", FLOATS: "TYPE_FP32",
                 TEXT: "TYPE_STRING", OBJECT: "TYPE_STRING"}
_LISTS = (WORDS, TOKEN_IDS, FLOATS)

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class Shown(str):
    """A stand-in for a value too big or too structured to echo back in a message (a shape, a byte count)."""


def refuse(name: str, value: Any, allowed: str, problem: str = "is invalid") -> InvalidRequestError:
    """The one message format: `name=value problem: allowed ...`; clients match on how it starts. The value
    is shown with repr, cut at 80 characters; a Shown value is shown as it is."""
    shown = str(value) if isinstance(value, Shown) else repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return InvalidRequestError(f"{name}={shown} {problem}: allowed {allowed}")


def parse_bool(text: str) -> bool | None:
    """The one boolean grammar (requests and config.pbtxt alike): true/false, 1/0, yes/no, on/off, any case.
    None when `text` is none of them."""
    lowered = text.strip().lower()
    return True if lowered in _TRUE else False if lowered in _FALSE else None


@dataclass(frozen=True)
class RequestLimits:
    """Abuse caps on list-valued fields and the sampling_parameters JSON, checked before any work."""
    max_json_bytes: int = 64 << 10
    max_stop_words: int = 32  # stop and bad words, each list
    max_word_bytes: int = 1024  # one stop or bad word
    max_stop_token_ids: int = 64
    max_grammar_bytes: int = 32 << 10  # a schema, regex, grammar or guide (structured output)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name}={value!r} is out of range: allowed an integer >= 1")


NO_LIMITS = RequestLimits(max_json_bytes=1 << 62, max_stop_words=1 << 62, max_word_bytes=1 << 62,
                          max_stop_token_ids=1 << 62, max_grammar_bytes=1 << 62)


@dataclass(frozen=True)
class Field:
    name: str
    kind: str
    default: Any
    help: str
    lo: float | None = None  # allowed range; None: unbounded on that side
    hi: float | None = None
    lo_open: bool = False  # (lo, ... instead of [lo, ...
    hi_open: bool = False  # ..., hi) instead of ..., hi]
    allowed_text: str = ""  # how the range reads in messages, where the default wording would not say it well
    aliases: tuple[str, ...] = ()  # the same field under other clients' names
    inputs: tuple[str, ...] | None = None  # names declared as input tensors; None: the name and every alias
    tensor_type: str = ""  # Triton type of those inputs; "": from the kind
    openai: str = ""  # the key in OpenAI request bodies; "": not taken from them (or mapped by hand)
    openai_hi: int | None = None  # OpenAI's own bound, where its API declares a narrower type (exclusive)
    sampling: bool = True  # a SamplingParams field; False: a serving flag (serving.contract.ParsedRequest)
    # A peer's feature we do not have: accepted only at its default (what clients send when they do not use
    # it), refused otherwise with this reason.
    unsupported: str = ""
    choices: tuple[str, ...] = ()  # TEXT: the values allowed; (): any text

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.names if self.inputs is None else self.inputs

    @property
    def triton_type(self) -> str:
        return self.tensor_type or _TRITON_TYPES[self.kind]

    @property
    def dims(self) -> list[int]:
        return [-1] if self.kind in _LISTS else [1]

    def for_openai(self) -> "Field":
        """The field as OpenAI's API bounds it (seed is an int64 there, a uint64 for TensorRT-LLM's clients)."""
        return self if self.openai_hi is None else dataclasses.replace(self, hi=self.openai_hi, hi_open=True)

    @property
    def allowed(self) -> str:
        if self.allowed_text:
            return self.allowed_text
        if self.unsupported:
            return f"only {_shown_default(self.default)} ({self.unsupported})"
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        noun = {INT: "an integer", FLOAT: "a number", BOOL: "a boolean (true/false, 1/0)",
                WORDS: "a string or a list of strings", TOKEN_IDS: "a list of token ids >= 0",
                FLOATS: "a list of numbers", TEXT: "a string", OBJECT: "a JSON object (or its JSON text)"}[self.kind]
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            return f"{noun} in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        if self.lo is not None:
            return f"{noun} {'>' if self.lo_open else '>='} {_num(self.lo)}"
        return noun

    def parse(self, value: Any, name: str | None = None, limits: RequestLimits = NO_LIMITS) -> Any:
        """The canonical value of `value` (strings and numpy scalars as clients send them), or
        InvalidRequestError naming `name` (the name the client used; default the field's own)."""
        name = name or self.name
        value = _as_text(name, value)
        if value is None and self.default is None:
            return None
        parsed = self._parse(name, value, limits)
        if self.unsupported and parsed != (list(self.default) if isinstance(self.default, tuple) else self.default):
            raise refuse(name, value, self.allowed, "is not supported")
        return parsed

    def _parse(self, name: str, value: Any, limits: RequestLimits) -> Any:
        if self.kind == BOOL:
            return _to_bool(name, value)
        if self.kind == WORDS:
            return _to_words(name, value, limits)
        if self.kind == TOKEN_IDS:
            return _to_token_ids(name, value, limits)
        if self.kind == TEXT:
            return _to_text(name, value, self.choices, limits)
        if self.kind == OBJECT:
            return _to_object(name, value, limits)
        if self.kind == FLOATS:
            values = value if isinstance(value, (list, tuple)) else [value]
            return [_to_float(name, _as_text(name, v), self.allowed) for v in values]
        number = _to_int(name, value, self.allowed) if self.kind == INT else _to_float(name, value, self.allowed)
        if not self.in_range(number):
            raise refuse(name, value, self.allowed, "is out of range")
        return number

    def in_range(self, number: float) -> bool:
        if self.lo is not None and (number < self.lo or (self.lo_open and number == self.lo)):
            return False
        return self.hi is None or not (number > self.hi or (self.hi_open and number == self.hi))


def _shown_default(default: Any) -> str:
    if isinstance(default, tuple):
        return "an empty list"
    return str(default).lower() if isinstance(default, bool) else repr(default)


def _num(x: float) -> str:
    if isinstance(x, int) and x >= 2**32 and x & (x - 1) == 0:
        return f"2^{x.bit_length() - 1}"  # the bounds of 64-bit integer types
    return str(int(x)) if float(x).is_integer() else str(x)


def _as_text(name: str, value: Any) -> Any:
    if isinstance(value, np.generic) and not isinstance(value, np.bytes_):
        value = value.item()
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise refuse(name, value, "UTF-8 text") from None
    return value


def _to_int(name: str, value: Any, allowed: str) -> int:
    if isinstance(value, bool):
        raise refuse(name, value, allowed)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise refuse(name, value, allowed)


def _to_float(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool):
        raise refuse(name, value, allowed)
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise refuse(name, value, allowed) from None
    if not math.isfinite(number):
        raise refuse(name, value, allowed)
    return number


def _to_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and parse_bool(value) is not None:
        return parse_bool(value)
    raise refuse(name, value, "a boolean (true/false, 1/0)")


def _to_words(name: str, value: Any, limits: RequestLimits) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise refuse(name, value, "a string or a list of strings")
    if len(value) > limits.max_stop_words:
        raise refuse(name, Shown(f"<{len(value)} words>"), f"at most {limits.max_stop_words} words")
    words = []
    for item in value:
        item = _as_text(name, item)
        if not isinstance(item, str):
            raise refuse(name, item, "strings")
        if not item:
            continue  # TensorRT-LLM clients send "" to mean no word
        if len(item.encode("utf-8")) > limits.max_word_bytes:
            raise refuse(name, item, f"words of at most {limits.max_word_bytes} bytes")
        words.append(item)
    return words


def _to_text(name: str, value: Any, choices: tuple[str, ...], limits: RequestLimits) -> str:
    if not isinstance(value, str):
        raise refuse(name, value, f"one of {', '.join(choices)}" if choices else "a string")
    if choices and value not in choices:
        raise refuse(name, value, f"one of {', '.join(choices)}", "is not supported")
    if len(value.encode("utf-8")) > limits.max_grammar_bytes:
        raise refuse(name, Shown(f"<{len(value.encode('utf-8'))} bytes>"), f"at most {limits.max_grammar_bytes} bytes")
    return value


def _to_object(name: str, value: Any, limits: RequestLimits) -> dict:
    """A JSON object as clients send it: an object (a sampling_parameters key) or its JSON text (a request
    parameter, which Triton keeps to scalars). Its size counts as JSON text, whichever way it came."""
    text = value if isinstance(value, str) else None
    if text is None:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            raise refuse(name, value, "a JSON object") from None
    if len(text.encode("utf-8")) > limits.max_grammar_bytes:
        raise refuse(name, Shown(f"<{len(text.encode('utf-8'))} bytes>"), f"at most {limits.max_grammar_bytes} bytes")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise refuse(name, text, f"a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise refuse(name, value, "a JSON object")
    return value


def _to_token_ids(name: str, value: Any, limits: RequestLimits) -> list[int]:
    if not isinstance(value, (list, tuple)):
        value = [value]
    if len(value) > limits.max_stop_token_ids:
        raise refuse(name, Shown(f"<{len(value)} ids>"), f"at most {limits.max_stop_token_ids} token ids")
    allowed = "a list of token ids >= 0"
    ids = [_to_int(name, _as_text(name, v), allowed) for v in value]
    for i in ids:
        if not 0 <= i < 2**31:
            raise refuse(name, i, allowed, "is out of range")
    return ids


MAX_LOGPROBS = 20  # top logprobs per token a request may ask for (vLLM's default max_logprobs)
MAX_N = 16  # samples of one prompt

FIELDS: tuple[Field, ...] = (
    # ---- sampling: SamplingParams, in this order -------------------------------------------------------
    Field("max_tokens", INT, None, "output limit; default: the model's default_max_tokens (never 16)", lo=1,
          aliases=("request_output_len",)),
    Field("temperature", FLOAT, 1.0, "0 = greedy", lo=0, hi=100, openai="temperature"),
    Field("top_p", FLOAT, 1.0, "nucleus sampling mass", lo=0, hi=1, lo_open=True, aliases=("runtime_top_p",),
          openai="top_p"),
    Field("top_k", INT, -1, "-1 or 0 = no limit", lo=-1, allowed_text="an integer >= -1 (-1 or 0: no limit)",
          aliases=("runtime_top_k",), openai="top_k"),
    Field("min_p", FLOAT, 0.0, "drop tokens below min_p x the top token's probability", lo=0, hi=1,
          inputs=(), openai="min_p"),
    Field("repetition_penalty", FLOAT, 1.0, "over prompt and output (vLLM); 1 = off", lo=0, hi=10, lo_open=True,
          openai="repetition_penalty"),
    Field("presence_penalty", FLOAT, 0.0, "over output tokens (OpenAI)", lo=-2, hi=2, openai="presence_penalty"),
    Field("frequency_penalty", FLOAT, 0.0, "over output tokens (OpenAI)", lo=-2, hi=2, openai="frequency_penalty"),
    Field("min_tokens", INT, 0, "EOS and stop_token_ids cannot end the output before this many tokens", lo=0,
          aliases=("min_length",), openai="min_tokens"),
    Field("seed", INT, None, "per-request generator: the same output whatever shares the batch", lo=0, hi=2**64,
          hi_open=True, aliases=("random_seed",), tensor_type="TYPE_UINT64", openai="seed", openai_hi=2**63),
    Field("n", INT, 1, "samples of the prompt, sharing its KV blocks", lo=1, hi=MAX_N,
          aliases=("num_return_sequences",), openai="n"),
    Field("stop", WORDS, (), "stop strings, matched on text across token boundaries, cut from the output",
          aliases=("stop_words",), inputs=("stop_words",)),
    Field("stop_token_ids", TOKEN_IDS, (), "token ids that end the output", inputs=()),
    Field("end_id", INT, None, "the token id that ends the output instead of the model's EOS (TensorRT-LLM)",
          lo=0),
    Field("bad_words", WORDS, (), "words the sampler may not produce"),
    Field("ignore_eos", BOOL, False, "keep generating past EOS", openai="ignore_eos"),
    Field("logprobs", INT, None, "log-probabilities of this many top tokens per output token (vLLM), on the "
          "`logprobs` output", lo=0, hi=MAX_LOGPROBS, inputs=()),
    Field("skip_special_tokens", BOOL, True, "leave special tokens out of the text", inputs=()),
    # Structured output (docs/structured_output.md): vLLM's object, or TensorRT-LLM's guide type + guide.
    Field("structured_outputs", OBJECT, None, "constrain the output (vLLM): one of json (a schema), regex, "
          "choice (a list of strings), grammar (EBNF or Lark), json_object (true); options disable_any_whitespace, "
          "disable_additional_properties", aliases=("guided_decoding",), inputs=()),
    Field("guided_decoding_guide_type", TEXT, None, "constrain the output (TensorRT-LLM): json = any JSON; "
          "the others follow guided_decoding_guide", choices=("json", "json_schema", "regex", "ebnf_grammar")),
    Field("guided_decoding_guide", TEXT, None, "the schema, regex or EBNF grammar guided_decoding_guide_type "
          "names (TensorRT-LLM)"),
    Field("speculative_decoding", BOOL, True, "where the engine drafts tokens (speculative_method), verify several "
          "per step; false: one per step. The output is the same either way", inputs=()),
    # TensorRT-LLM features we do not have, accepted at the values its clients send when not using them.
    Field("beam_width", INT, 1, "beam search", unsupported="beam search is not implemented"),
    Field("length_penalty", FLOAT, 1.0, "beam search", unsupported="it applies to beam search only"),
    Field("embedding_bias_words", WORDS, (), "logit bias", unsupported="logit bias is not implemented"),
    Field("embedding_bias_weights", FLOATS, (), "logit bias", unsupported="logit bias is not implemented"),
    # ---- serving flags: serving.contract.ParsedRequest ---------------------------------------------------
    Field("stream", BOOL, False, "stream text deltas", aliases=("streaming",), sampling=False),
    Field("exclude_input_in_output", BOOL, True, "false: the prompt leads a non-streamed output (a streamed "
          "one never repeats it); default from the model's default_exclude_input_in_output", sampling=False),
    Field("apply_chat_template", BOOL, False, "text_input is a user message: render the model's chat template "
          "around it", sampling=False),
    Field("priority", INT, 0, "lower is served first", lo=-(2**31), hi=2**31 - 1,
          allowed_text="a 32-bit integer", sampling=False),
    Field("return_finish_reason", BOOL, False, "attach finish_reason (\"None\" until the last response)",
          sampling=False),
    Field("return_num_input_tokens", BOOL, False, "attach num_input_tokens", sampling=False),
    Field("return_num_output_tokens", BOOL, False, "attach num_output_tokens (tokens in this response)",
          sampling=False),
    Field("return_num_cached_tokens", BOOL, False, "attach num_cached_tokens (prompt tokens the prefix cache held "
          "when the request was admitted; OpenAI's usage.prompt_tokens_details.cached_tokens)", sampling=False),
    Field("return_cumulative_logprob", BOOL, False, "attach cumulative_logprob", sampling=False),
    Field("return_logprobs", BOOL, False, "attach logprobs: JSON, per token of this response, the top `logprobs` "
          "tokens (vLLM's layout); null when the request set no logprobs", sampling=False),
    Field("return_log_probs", BOOL, False, "attach cum_log_probs and output_log_probs (TensorRT-LLM)",
          sampling=False),
    Field("return_output_ids", BOOL, False, "attach output_ids: the token ids this response carries, every "
          "sample's in turn", sampling=False),
    Field("pad_id", INT, None, "TensorRT-LLM's padding id: accepted, never needed (outputs are not padded)",
          lo=0, sampling=False),
    Field("return_context_logits", BOOL, False, "TensorRT-LLM", unsupported="logits are not returned",
          sampling=False),
    Field("return_generation_logits", BOOL, False, "TensorRT-LLM", unsupported="logits are not returned",
          sampling=False),
)
BY_NAME: dict[str, Field] = {name: f for f in FIELDS for name in f.names}  # any name a client uses -> its field
SAMPLING_FIELDS = tuple(f for f in FIELDS if f.sampling)
SERVING_FIELDS = tuple(f for f in FIELDS if not f.sampling)


def input_tensors(fields: Iterable[Field] = FIELDS) -> list[tuple[str, str, list[int]]]:
    """(name, Triton type, dims) of every input tensor the fields may arrive as."""
    return [(name, f.triton_type, f.dims) for f in fields for name in f.input_names]


def sampling_dataclass(cls: type) -> type:
    """Make `cls` a dataclass whose fields are SAMPLING_FIELDS, in order, with their defaults."""
    annotations = {}
    for f in SAMPLING_FIELDS:
        annotations[f.name] = "Any"
        default = f.default
        setattr(cls, f.name, dataclasses.field(default_factory=list) if isinstance(default, tuple) else default)
    cls.__annotations__ = {**annotations, **cls.__dict__.get("__annotations__", {})}
    return dataclass(cls)
