"""Which JSON schemas the grammar enforces: the client's schema is rewritten into what xgrammar enforces exactly
(grammar/schema_rewrite.py), so that a keyword it would silently ignore is refused by name instead of producing
output that does not follow the schema the client wrote."""
from __future__ import annotations

from typing import Any

from .schema_rewrite import SchemaRefused, enforceable

# Where a rewritten schema's keywords hold schemas (the rest hold data: enum, const, ...); whoever walks a rewritten
# schema (grammar/cost.py, grammar/spec.py's disable_additional_properties) follows these keys and no others.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # a list of schemas
SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")  # one schema


def unsupported_keyword(schema: Any) -> tuple[str, str, str] | None:
    """The first keyword of `schema` the grammar could not enforce: (keyword, JSON pointer, why), or None."""
    try:
        enforceable(schema)
    except SchemaRefused as e:
        return (e.keyword, e.where, e.why)
    return None


__all__ = ["SCHEMA_LISTS", "SCHEMA_MAPS", "SCHEMA_VALUES", "SchemaRefused", "enforceable", "unsupported_keyword"]
