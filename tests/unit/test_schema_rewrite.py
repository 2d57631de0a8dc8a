"""JSON schemas as clients write them (drafts 04 to 2020-12), through the spec parser and xgrammar, without a model:
annotations and identifiers pass, references resolve anywhere, and whatever xgrammar would silently drop is either
enforced or refused by name. Enforced means: random walks through the compiled grammar over a byte vocabulary (any
string the grammar allows can come out) give only instances that `jsonschema` finds valid for the schema as
written."""
from __future__ import annotations

import json

import pytest

from inflight.fields import InvalidRequestError
from inflight.grammar.spec import from_structured_outputs
from perf.bench.jsonschemabench import ByteWalker, check

WALKS = 40
DRAFTS = ["http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-06/schema#",
          "http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2019-09/schema",
          "https://json-schema.org/draft/2020-12/schema"]


@pytest.fixture(scope="module")
def walker():
    return ByteWalker(seed=0)


def rewritten(schema) -> dict:
    return json.loads(from_structured_outputs({"json": schema}).text)


def refusal(schema) -> str:
    with pytest.raises(InvalidRequestError) as e:
        from_structured_outputs({"json": schema})
    return str(e.value)


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def assert_only_valid_instances(walker, schema) -> list:
    """Walks through the grammar the engine would compile for `schema`; every finished one must be valid."""
    grammar = walker.grammar(from_structured_outputs({"json": schema}).text)
    found = []
    for _ in range(WALKS):
        data = walker.walk(grammar)
        if data is None or not is_utf8(data):  # xgrammar allows UTF-8-encoded surrogates: not text
            continue
        why = check(schema, data.decode("utf-8"))
        assert not why, f"{data!r}: {why}"
        found.append(json.loads(data))
    assert len(found) >= WALKS // 2, f"only {len(found)} of {WALKS} walks finished"
    return found


# ---- annotations and identifiers -------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name"]}


@pytest.mark.parametrize("draft", DRAFTS)
def test_every_draft_from_04_is_read(draft):
    assert rewritten({"$schema": draft, **PERSON}) == rewritten(PERSON)


def test_annotations_and_unknown_keywords_are_ignored_as_json_schema_says():
    noisy = {"id": "http://example.com/person", "copyright": "(c) someone", "_format": "x", "x-order": 3,
             "readonly": True, "example": {"name": "a"}, "$comment": "c", "javaType": "Person", "title": "P",
             "type": "object", "required": ["name"],
             "properties": {"name": {"type": "string", "description": "d", "id": "/properties/name",
                                     "_uniqueItems": True, "nullable": True},
                            "age": {"type": "integer", "minimum": 0, "examples": [3], "default": 1}}}
    assert rewritten(noisy) == rewritten(PERSON)


def test_draft_03_is_refused_by_name():
    assert "'$schema' at /" in refusal({"$schema": "http://json-schema.org/draft-03/schema#", **PERSON})
    assert "'required' at /properties/a" in refusal({"properties": {"a": {"type": "string", "required": True}}})
    assert "'extends' at /" in refusal({"extends": {"type": "object"}})


# ---- references -------------------------------------------------------------------------------------------

ITEM = {"type": "integer", "minimum": 10, "maximum": 12}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/item"}}, "definitions": {"item": ITEM},
     "required": ["a"]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/item"}}, "$defs": {"item": ITEM}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/an%20item"}}, "$defs": {"an item": ITEM},
     "required": ["a"]},  # percent-encoded pointer
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/a~1b"}}, "$defs": {"a/b": ITEM}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": ITEM}, "required": ["a"]},
    {"$id": "https://example.com/root.json", "type": "object", "properties": {"a": {"$ref": "item.json"}},
     "$defs": {"item": {"$id": "item.json", **ITEM}}, "required": ["a"]},  # an embedded resource
    {"type": "object", "properties": {"a": {"$ref": "#num"}}, "$defs": {"n": {"$anchor": "num", **ITEM}},
     "required": ["a"]},  # 2019-09's $anchor
    {"$schema": DRAFTS[2], "type": "object", "properties": {"a": {"$ref": "#num"}},
     "definitions": {"n": {"$id": "#num", **ITEM}}, "required": ["a"]},  # draft-06/07's plain-name $id
    {"$schema": DRAFTS[0], "id": "http://example.com/s.json", "type": "object",
     "properties": {"a": {"$ref": "http://example.com/s.json#/definitions/item"}}, "definitions": {"item": ITEM},
     "required": ["a"]},  # draft-04's id, referred to by its URI
])
def test_references_resolve_wherever_they_point(walker, schema):
    for instance in assert_only_valid_instances(walker, schema):
        assert 10 <= instance["a"] <= 12


def test_a_recursive_schema_compiles_and_stays_valid(walker):
    tree = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
                                                                               "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["v"]}
    assert_only_valid_instances(walker, tree)
    # oneOf over the definition being defined: told apart by what its `type` says
    element = {"$ref": "#/$defs/element", "$defs": {"element": {"type": "object", "properties": {
        "child": {"oneOf": [{"type": "string"}, {"$ref": "#/$defs/element"}]}}}}}
    assert_only_valid_instances(walker, element)


def test_references_outside_the_schema_are_refused_by_name():
    message = refusal({"type": "object", "properties": {"a": {"$ref": "https://example.com/other.json"}}})
    assert "'$ref' at /properties/a" in message and "another document" in message
    assert "does not point at a schema" in refusal({"properties": {"a": {"$ref": "#/$defs/missing"}}})


# ---- what xgrammar drops without a word: enforced now -------------------------------------------------

@pytest.mark.parametrize("schema", [
    # a required name missing from properties (xgrammar left it out: {} came out)
    {"type": "object", "required": ["z"]},
    # a keyword of one type with no type (xgrammar allowed any value: 3 came out)
    {"type": "object", "properties": {"a": {"minimum": 5}}, "required": ["a"]},
    # enum values of another type (xgrammar wrote 1)
    {"type": "object", "properties": {"a": {"enum": [1, "one"], "type": "string"}}, "required": ["a"]},
    # keywords beside anyOf (xgrammar kept only the branches: any JSON)
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
     "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    # oneOf whose branches overlap (xgrammar wrote anyOf: both a and b)
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    # oneOf told apart by a property that is optional (now required: {} matched both branches)
    {"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
     "oneOf": [{"properties": {"kind": {"enum": ["a"]}}}, {"properties": {"kind": {"enum": ["b", "c"]}}}]},
    # keywords beside $ref, 2020-12 (xgrammar kept only the target)
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/n", "minimum": 10}}, "required": ["a"],
     "$defs": {"n": {"type": "integer"}}},
    # patternProperties over a named property (xgrammar used the property's schema alone)
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "patternProperties": {"^a": {"type": "integer", "minimum": 5}}},
    # format date (xgrammar's rule allows 31 February)
    {"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 20},
    # uniqueItems (xgrammar ignored it): at most one item
    {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
    # allOf of several schemas (xgrammar allowed any JSON)
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"properties": {"a": {"maximum": 3}}}]},
    # draft-04's forms: boolean exclusiveMinimum, items as a tuple with additionalItems
    {"$schema": DRAFTS[0], "type": "array", "items": [{"type": "number", "minimum": 3, "exclusiveMinimum": True}],
     "additionalItems": False, "minItems": 1},
    # fractional bounds on an integer, and multipleOf
    {"type": "object", "properties": {"i": {"type": "integer", "minimum": 0.5, "maximum": 3.5},
                                      "m": {"type": "number", "multipleOf": 0.5}}, "required": ["i", "m"]},
    # not: a set of required names, and not {} (a property that must be absent)
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"not": {}}},
     "additionalProperties": True, "not": {"required": ["a", "b"]}},
    # keys from a pattern that allows '"' (xgrammar wrote it into the key unescaped): objects keep named keys only
    {"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^.{1,8}$": {}}},
    # multipleOf beside bounds (xgrammar enforced one of the two: 14 for maximum 99, multipleOf 10)
    {"type": "integer", "multipleOf": 10, "minimum": 5, "maximum": 99},
    # arrays without items, objects with minProperties (xgrammar's strict mode allowed none: compile errors)
    {"type": "object", "properties": {"list": {"type": "array", "minItems": 2},
                                      "map": {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 2}},
     "required": ["list", "map"]},
    # integer bounds past 2^53 (xgrammar refused to compile them)
    {"type": "integer", "minimum": 0, "maximum": 9223372036854775807},
    # dependencies (draft-07) / dependentRequired
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
     "dependencies": {"a": ["b"]}, "dependentRequired": {"b": ["a"]}},
])
def test_what_xgrammar_would_drop_is_enforced(walker, schema):
    assert_only_valid_instances(walker, schema)


@pytest.mark.parametrize("schema, where, words", [
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "'oneOf' at /oneOf", ["may both match"]),
    ({"type": "array", "uniqueItems": True, "minItems": 2}, "'uniqueItems' at /", ["distinct"]),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if' at /", ["condition"]),
    ({"type": "string", "not": {"pattern": "^x"}}, "'not' at /not", ["not supported"]),
    ({"type": "array", "contains": {"const": 1}}, "'contains' at /", ["not supported"]),
    ({"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}, "'pattern' at /allOf/1", ["two patterns"]),
    ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties' at /", ["not supported"]),
    ({"type": "string", "format": "date", "maxLength": 10}, "'maxLength' at /", ["beside 'format'"]),
])
def test_what_cannot_be_enforced_is_refused_by_keyword_and_place(schema, where, words):
    message = refusal(schema)
    assert where in message and all(w in message for w in words), message


def test_an_unsatisfiable_schema_is_refused_not_compiled():
    message = refusal({"type": "object", "properties": {"a": {"type": "string", "enum": [1, 2]}}, "required": ["a"]})
    assert "no value can satisfy" in message


# ---- lengths beside a pattern: kept where the pattern's own widths already meet them ------------------

@pytest.mark.parametrize("schema", [
    # JSONSchemaBench Github_medium/o68447: a date-time pattern 20-24 characters long, lengths 4-24
    {"type": "string", "minLength": 4, "maxLength": 24,
     "pattern": "^((([0-9]{4})-([0-9][0-9])-([0-9][0-9]))T([0-9][0-9]:[0-9][0-9]:[0-9][0-9](.[0-9][0-9][0-9]?)?)Z)$"},
    # Snowplow/sp_267: a UUID (36) or 16 hex digits, maxLength 36
    {"type": "string", "maxLength": 36, "pattern": "^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$|^[0-9a-f]{16}$"},
    # Github_ultra/o65671: unanchored (xgrammar writes whole matches, so never a longer string holding one)
    {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "[a-zA-Z]{3}"},
    # Github_medium/o63937: one class repeated, its lengths 3-63 written into the repetition
    {"type": "string", "minLength": 3, "maxLength": 63, "pattern": "^[0-9a-zA-Z\\.\\-_]+$"},
    {"type": "string", "minLength": 2, "pattern": "^[a-c]{1,5}$"},
    {"type": "string", "maxLength": 4, "pattern": "x*"},
])
def test_lengths_the_pattern_already_meets_are_kept_by_it(walker, schema):
    assert_only_valid_instances(walker, {"type": "object", "properties": {"s": schema}, "required": ["s"]})


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[a-z]+[0-9]$", "minLength": 3},  # the pattern allows "a1"
    {"type": "string", "pattern": "^([a-z]{2,9})$", "maxLength": 8},  # ... nine letters in a group
    {"type": "string", "pattern": "^(\\d+\\.\\d+\\.\\d+.*)$", "maxLength": 32},  # unbounded
])
def test_lengths_the_pattern_may_break_are_still_refused(schema):
    assert "beside 'pattern'" in refusal({"type": "object", "properties": {"s": schema}})


def test_a_repetition_no_length_allows_is_refused_as_unsatisfiable():
    message = refusal({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{1,3}$",
                                                              "minLength": 5}}, "required": ["s"]})
    assert "no value can satisfy" in message and "pattern" in message, message
