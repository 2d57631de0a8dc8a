"""What a request constrains its output to: one GrammarSpec, from whichever way it arrived.

vLLM's `structured_outputs` (older name `guided_decoding`): an object with one of json, regex, choice, grammar,
json_object (plus options); TensorRT-LLM's `guided_decoding_guide_type` + `guided_decoding_guide`; the OpenAI
frontend maps `response_format` and tool choices onto vLLM's form. Everything here is checked in the caller's
thread (parsing, shape, size, JSON-schema keywords); compiling is the compiler's (grammar/compiler.py), off the
engine thread. No grammar library is imported here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ..fields import InvalidRequestError, Shown, refuse
from .cost import CompileCost, check_cost, regex_cost, schema_cost
from .schema_check import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES, SchemaRefused, enforceable

# The spec kinds the compiler knows.
JSON_SCHEMA, JSON_OBJECT, JSON_ANY, REGEX, CHOICE, EBNF, LARK = (
    "json_schema", "json_object", "json_any", "regex", "choice", "ebnf", "lark")

# vLLM's StructuredOutputsParams: the keys that say what to follow (exactly one) and the options beside them.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties",
                      "whitespace_pattern", "backend")
# Values of vLLM's `backend` option this engine honours: it has one library, xgrammar.
BACKENDS = ("auto", "xgrammar")
# TensorRT-LLM's guided_decoding_guide_type values.
TRTLLM_GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
MAX_CHOICES = 256


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint, as the compiler takes it; equal specs share one compiled grammar (the cache key).

    text: the JSON of the schema as the grammar enforces it (grammar/schema_rewrite.py; the client's property order
    kept: it shapes the output), the regex, the grammar, or the choices as a JSON list. any_whitespace: JSON may
    carry free whitespace between tokens."""
    kind: str
    text: str
    any_whitespace: bool = True
    source: str = "structured_outputs"  # the field a compile error names
    cost: CompileCost = field(default_factory=CompileCost, compare=False)  # told from the text (grammar/cost.py)

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def _json_text(name: str, value: Any) -> str:
    """A schema given as an object or as JSON text -> the JSON text of what the grammar enforces of it
    (grammar/schema_rewrite.py; property order kept)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise refuse(name, value, f"a JSON schema (an object) ({e})") from None
    else:
        parsed = value
    if not isinstance(parsed, (dict, bool)):
        raise refuse(name, value, "a JSON schema (an object)")
    try:
        rewritten = enforceable(parsed)
    except SchemaRefused as e:
        raise InvalidRequestError(f"{name}: schema keyword {e.keyword!r} at {e.where or '/'} is not supported: "
                                  f"{e.why}") from None
    return json.dumps(rewritten, ensure_ascii=False)


def _choice_text(name: str, value: Any) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise refuse(name, value, "a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise refuse(name, Shown(f"<{len(value)} choices>"), f"at most {MAX_CHOICES} choices")
    return json.dumps(value, ensure_ascii=False)


def _text(name: str, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise refuse(name, value, what)
    return value


def costed(spec: GrammarSpec) -> GrammarSpec:
    """The spec with what it will cost to compile; refused by name when that is more than any request may cost."""
    if spec.kind == JSON_SCHEMA:
        cost = schema_cost(spec.text, spec.source)
    elif spec.kind in (REGEX, EBNF, LARK):
        cost = regex_cost(spec.text)
    else:
        return spec
    check_cost(cost, spec.source)
    return replace(spec, cost=cost)


def from_structured_outputs(obj: Any, name: str = "structured_outputs") -> GrammarSpec:
    """vLLM's structured_outputs / guided_decoding object (already a dict) -> a spec, or InvalidRequestError."""
    return costed(_from_structured_outputs(obj, name))


def _from_structured_outputs(obj: Any, name: str) -> GrammarSpec:
    if not isinstance(obj, dict):
        raise refuse(name, obj, f"a JSON object with one of {', '.join(STRUCTURED_KINDS)}")
    unknown = sorted(k for k in obj if k not in STRUCTURED_KINDS + STRUCTURED_OPTIONS)
    if unknown:
        raise InvalidRequestError(f"{name} key {unknown[0]!r} is unknown: allowed keys are "
                                  f"{', '.join(STRUCTURED_KINDS + STRUCTURED_OPTIONS)}")
    given = [k for k in STRUCTURED_KINDS if obj.get(k) not in (None, False)]
    if len(given) != 1:
        raise refuse(name, obj, f"exactly one of {', '.join(STRUCTURED_KINDS)}",
                     "sets none" if not given else f"sets {len(given)} ({', '.join(given)})")
    backend = obj.get("backend")
    if backend is not None and backend not in BACKENDS:
        raise refuse(f"{name}.backend", backend, f"{', '.join(BACKENDS)} (this server compiles with xgrammar)",
                     "is not supported")
    for flag in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
        if obj.get(flag) is not None and not isinstance(obj[flag], bool):
            raise refuse(f"{name}.{flag}", obj[flag], "a boolean")
    if obj.get("whitespace_pattern") is not None:
        raise refuse(f"{name}.whitespace_pattern", obj["whitespace_pattern"], "null (use disable_any_whitespace)",
                     "is not supported")
    any_ws = not obj.get("disable_any_whitespace", False)
    kind = given[0]
    key = f"{name}.{kind}"
    if kind == "json":
        text = _json_text(key, obj["json"])
        if obj.get("disable_additional_properties"):
            text = json.dumps(_closed(json.loads(text)), ensure_ascii=False)
        return GrammarSpec(JSON_SCHEMA, text, any_ws, key)
    if kind == "json_object":
        if obj["json_object"] is not True:
            raise refuse(key, obj["json_object"], "true")
        return GrammarSpec(JSON_OBJECT, "", any_ws, key)
    if kind == "regex":
        return GrammarSpec(REGEX, _text(key, obj["regex"], "a regular expression"), True, key)
    if kind == "choice":
        return GrammarSpec(CHOICE, _choice_text(key, obj["choice"]), True, key)
    text = _text(key, obj["grammar"], "an EBNF grammar (xgrammar's, with a `root` rule) or a Lark grammar")
    return GrammarSpec(EBNF if "::=" in text else LARK, text, True, key)


def from_trtllm(guide_type: str | None, guide: str | None) -> GrammarSpec | None:
    """TensorRT-LLM's guided_decoding_guide_type + guided_decoding_guide -> a spec (None: neither given)."""
    spec = _from_trtllm(guide_type, guide)
    return costed(spec) if spec is not None else None


def _from_trtllm(guide_type: str | None, guide: str | None) -> GrammarSpec | None:
    if guide_type is None:
        if guide is not None:
            raise refuse("guided_decoding_guide", guide, "only with guided_decoding_guide_type set",
                         "is given alone")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise refuse("guided_decoding_guide_type", guide_type, ", ".join(TRTLLM_GUIDE_TYPES), "is not supported")
    if guide_type == "json":  # any JSON; TensorRT-LLM ignores the guide here
        return GrammarSpec(JSON_ANY, "", True, "guided_decoding_guide_type")
    if guide is None:
        raise refuse("guided_decoding_guide", guide, f"a guide for guided_decoding_guide_type={guide_type!r}",
                     "is missing")
    if guide_type == "json_schema":
        return GrammarSpec(JSON_SCHEMA, _json_text("guided_decoding_guide", guide), True, "guided_decoding_guide")
    if guide_type == "regex":
        return GrammarSpec(REGEX, _text("guided_decoding_guide", guide, "a regular expression"), True,
                           "guided_decoding_guide")
    return GrammarSpec(EBNF, _text("guided_decoding_guide", guide, "an EBNF grammar with a `root` rule"), True,
                       "guided_decoding_guide")


def _closed(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without additionalProperties gets false.

    Only the keys that hold schemas are followed (schema_check's lists: the schema was rewritten already, so
    those are the only ones it has): const, enum, default and examples hold data, which may look like
    a schema but must reach the grammar as written."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema
    out = dict(schema)
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_closed(sub) for sub in value]
        elif key in SCHEMA_VALUES and isinstance(value, dict):
            out[key] = _closed(value)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def spec_of(params: Any) -> GrammarSpec | None:
    """The request's constraint, from its SamplingParams fields (they were parsed already); refuses two ways at
    once."""
    structured = params.structured_outputs
    trt = from_trtllm(params.guided_decoding_guide_type, params.guided_decoding_guide)
    if structured is not None and trt is not None:
        raise InvalidRequestError("structured_outputs conflicts with guided_decoding_guide_type: give one "
                                  "constraint")
    return from_structured_outputs(structured) if structured is not None else trt
