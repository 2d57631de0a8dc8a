"""Which JSON-schema keywords the compiler enforces, so that one it would silently ignore (xgrammar drops `if`,
`not`, `patternProperties`, ... without a word) is refused by name instead of producing output that does not
follow the schema the client wrote."""
from __future__ import annotations

from typing import Any

# Keywords xgrammar's JSON-schema converter turns into grammar (its "Supported JSON Schema" page).
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
# Keywords that describe and constrain nothing: accepted and ignored, as every validator does.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", "name", "contentMediaType", "contentEncoding", "$anchor",
})
# Where an enforced keyword's value holds schemas (the rest hold data: enum, const, default, ...); whoever walks a
# schema (this check, grammar/spec.py's disable_additional_properties) follows these keys and no others.
SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # a list of schemas
SCHEMA_VALUES = ("items", "additionalProperties")  # one schema


def unsupported_keyword(schema: Any, where: str = "") -> tuple[str, str, str] | None:
    """The first keyword of `schema` that would not be enforced: (keyword, JSON pointer, why), or None."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return ("<schema>", where, f"a schema must be an object or a boolean, not {type(schema).__name__}")
    for key, value in schema.items():
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in ENFORCED:
            return (key, where, f"the grammar would not enforce it; allowed keywords are {', '.join(sorted(ENFORCED))}")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            return (key, where, "allOf with more than one schema cannot be enforced; merge them into one")
        found = None
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for sub_name, sub in value.items():
                found = found or unsupported_keyword(sub, f"{where}/{key}/{sub_name}")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                found = found or unsupported_keyword(sub, f"{where}/{key}/{i}")
        elif key in SCHEMA_VALUES and not isinstance(value, list):
            found = unsupported_keyword(value, f"{where}/{key}")
        if found:
            return found
    return None
