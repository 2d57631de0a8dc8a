"""OpenAI request bodies as other servers' clients write them, without a server: integers read exactly (not
through float), other dialects' constraint fields honoured or refused by name (never ignored), and tools whose
parameters use $defs/$ref under every tool_choice."""
from __future__ import annotations

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from inflight.sequence import SamplingParams
from openai_frontend.errors import APIError
from openai_frontend.protocol import parse_chat, parse_completion
from openai_frontend.triton_io import ModelInfo, build_request

ASK = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SEED_INPUT = {"name": "m", "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
                                     {"name": "seed", "data_type": "TYPE_UINT64", "dims": ["1"]}],
              "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["-1"]}]}


def refusal(parse, body: dict) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    return e.value


# ---- integers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "p"}), (parse_chat, {"messages": ASK})])
def test_the_largest_int64_seed_reaches_the_model_exactly(parse, body):
    req = parse({"model": "m", "seed": 2**63 - 1, **body})
    assert req.sampling["seed"] == 2**63 - 1 and isinstance(req.sampling["seed"], int)
    tensors, _ = build_request(ModelInfo.from_config(SEED_INPUT), "p", req.sampling)
    assert tensors["seed"].dtype == np.uint64 and int(tensors["seed"][0]) == 2**63 - 1


@pytest.mark.parametrize("seed", [2**63, 2**64, 9.3e18])
def test_a_seed_past_int64_is_refused_with_the_field_value_and_range(seed):
    err = refusal(parse_completion, {"model": "m", "prompt": "p", "seed": seed})
    assert err.status == 400 and err.param == "seed"
    assert err.message == f"seed={int(seed)} is out of range: allowed an integer in [0, 2^63)", err.message


def test_integers_are_read_exactly_and_whole_floats_still_pass():
    assert parse_completion({"model": "m", "prompt": "p", "max_tokens": 7.0}).sampling["max_tokens"] == 7
    err = refusal(parse_completion, {"model": "m", "prompt": "p", "n": 2.5})
    assert err.param == "n" and "n=2.5 is not an integer" in err.message
    big = 2**53 + 1  # not a float: float(big) != big, which the old check took for "not an integer"
    assert parse_completion({"model": "m", "prompt": "p", "top_k": big}).sampling["top_k"] == big


# ---- other servers' constraint fields ---------------------------------------------------------------------

@pytest.mark.parametrize("parse, body", [(parse_completion, {"prompt": "p"}), (parse_chat, {"messages": ASK})])
@pytest.mark.parametrize("given, expected", [
    ({"json_schema": SCHEMA}, {"json": SCHEMA}),  # llama.cpp
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, {"json": SCHEMA}),  # llama.cpp
    ({"response_format": {"type": "json_object", "value": SCHEMA}}, {"json": SCHEMA}),  # TGI
    ({"grammar": {"type": "json", "value": SCHEMA}}, {"json": SCHEMA}),  # TGI
    ({"grammar": {"type": "regex", "value": "a+"}}, {"regex": "a+"}),  # TGI
    ({"regex": "[0-9]+"}, {"regex": "[0-9]+"}),  # SGLang
    ({"ebnf": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),  # SGLang (xgrammar's EBNF)
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),  # vLLM
    ({"guided_choice": ["a", "b"], "guided_decoding_backend": "xgrammar"}, {"choice": ["a", "b"],
                                                                            "backend": "xgrammar"}),
])
def test_other_servers_constraints_are_honoured(parse, body, given, expected):
    req = parse({"model": "m", **body, **given})
    assert req.sampling["structured_outputs"] == expected
    SamplingParams(structured_outputs=expected)  # and the engine takes it


@pytest.mark.parametrize("given, field, words", [
    ({"grammar": 'root ::= "yes" | "no"'}, "grammar", ["GBNF", "structured_outputs"]),  # llama.cpp
    ({"grammar": {"type": "xml", "value": "x"}}, "grammar", ["json", "regex"]),
    ({"grammar_triggers": [{"type": "word", "value": "<tool>"}]}, "grammar_triggers", ["not supported"]),
    ({"grammar_lazy": True}, "grammar_lazy", ["not supported"]),
    ({"guided_whitespace_pattern": " ?"}, "guided_whitespace_pattern", ["not supported"]),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "outlines"}, "guided_decoding_backend", ["xgrammar"]),
    ({"structural_tag": "{}"}, "structural_tag", ["not supported"]),
    ({"json_schema": SCHEMA, "guided_regex": "a"}, "json_schema", ["guided_regex", "give one"]),
])
def test_constraints_that_cannot_be_honoured_are_refused_by_name(given, field, words):
    for parse, body in ((parse_completion, {"prompt": "p"}), (parse_chat, {"messages": ASK})):
        err = refusal(parse, {"model": "m", **body, **given})
        assert err.status == 400 and field in (err.param, err.message), err.message
        assert all(w in err.message for w in words), err.message


def test_unconstraining_values_of_those_fields_pass():
    req = parse_chat({"model": "m", "messages": ASK, "grammar": "", "grammar_lazy": False, "grammar_triggers": [],
                      "guided_decoding_backend": "auto", "json_schema": None})
    assert "structured_outputs" not in req.sampling


# ---- tools with $defs -------------------------------------------------------------------------------------

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "$defs": {"Unit": UNIT}}}}
# The same definition name, another meaning: each function's references must name its own.
DISTANCE = {"type": "function", "function": {"name": "get_distance", "parameters": {
    "type": "object", "properties": {"km": {"$ref": "#/definitions/Unit"}}, "required": ["km"],
    "definitions": {"Unit": {"type": "integer", "minimum": 0}}}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_parameters_with_refs_compile_under_every_tool_choice(tool_choice):
    req = parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, DISTANCE], "tool_choice": tool_choice})
    spec = SamplingParams(structured_outputs=req.sampling["structured_outputs"]).grammar
    grammar = xgr.Grammar.from_json_schema(spec.text)  # before: "Cannot find field $defs in #/$defs/Unit"
    assert "celsius" in str(grammar)  # the definition reached the grammar
    schema = req.sampling["structured_outputs"]["json"]
    if tool_choice == "required":
        good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
                {"name": "get_distance", "arguments": {"km": 3}}]
        jsonschema.validate(good, schema)
        for bad in ([{"name": "get_distance", "arguments": {"km": "celsius"}}],
                    [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": 3}}]):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(bad, schema)
