"""Grammar specs without an engine: what vLLM's disable_additional_properties option does to a JSON schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

from inflight.sequence import SamplingParams

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
# Data values that look like object schemas: the option must leave them exactly as written.
DATA = {
    "const": {"type": "object"},
    "enum": [{"type": "object"}, {"type": "object", "properties": {}}],
}
# Annotations holding such data: the grammar never sees them (JSON Schema says they constrain nothing).
ANNOTATIONS = {
    "default": {"type": "object"},
    "examples": [{"type": "object"}],
}


def closed(schema: dict) -> dict:
    spec = SamplingParams(structured_outputs={"json": schema, "disable_additional_properties": True}).grammar
    return json.loads(spec.text)


@pytest.mark.parametrize("keyword", sorted(DATA))
def test_data_values_are_not_edited(keyword):
    schema = {"type": "object", "properties": {"v": {keyword: DATA[keyword]}}}
    assert closed(schema)["properties"]["v"] == {keyword: DATA[keyword]}


@pytest.mark.parametrize("keyword", sorted(ANNOTATIONS))
def test_annotations_are_left_out(keyword):
    schema = {"type": "object", "properties": {"v": {"type": "integer", keyword: ANNOTATIONS[keyword]}}}
    assert closed(schema)["properties"]["v"] == {"type": "integer"}


def test_every_object_schema_is_closed_and_an_open_one_is_kept():
    schema = {
        "type": "object",
        "properties": {"one": {"$ref": "#/$defs/thing"}, "any": {"anyOf": [OBJ, {"type": "string"}]},
                       "list": {"type": "array", "items": OBJ}, "pair": {"prefixItems": [OBJ]},
                       "open": {"type": "object", "additionalProperties": True},
                       "map": {"type": "object", "additionalProperties": OBJ}},
        "$defs": {"thing": OBJ},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False and out["$defs"]["thing"]["additionalProperties"] is False
    props = out["properties"]
    assert props["any"]["anyOf"][0]["additionalProperties"] is False and props["any"]["anyOf"][1] == {"type": "string"}
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["map"]["additionalProperties"]["additionalProperties"] is False
    jsonschema.validate({"one": {"a": 1}, "list": [{"a": 2}]}, out)
    for extra in ({"x": 1}, {"one": {"a": 1, "x": 1}}, {"list": [{"x": 1}]}, {"map": {"k": {"a": 1, "x": 1}}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, out)


def test_without_the_option_the_schema_is_kept_as_written():
    schema = {"type": "object", "properties": {"v": {"const": {"type": "object"}}}}
    assert json.loads(SamplingParams(structured_outputs={"json": schema}).grammar.text) == schema
