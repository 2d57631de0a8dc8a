"""A JSON schema as clients write it -> the schema xgrammar enforces, or a refusal naming the keyword and where.

Drafts 04, 06, 07, 2019-09 and 2020-12 are read. As JSON Schema says, annotations and unknown keywords are ignored
(`title`, `x-*`, `copyright`, `_format`, a `format` the grammar does not implement), identifiers (`$id`, draft-04's
`id`, `$anchor`) only locate `$ref` targets, and a `$ref` may point anywhere inside the schema.

xgrammar's converter drops, without a word, much of what it does not enforce: the siblings of `$ref` and of
`anyOf`, `required` names that `properties` lacks, `{"minimum": 5}` without a `type`, enum values of another type,
`patternProperties` over a named property, the overlap of `oneOf` branches, `not`, `if`, `uniqueItems`. So the
schema is rewritten first into the part of JSON Schema it enforces exactly: conjunctions (`allOf`, `$ref` beside
other keywords, the keywords beside `anyOf`/`oneOf`) are merged, references become `#/$defs/...`, and the rest is
made explicit. Every instance of the rewritten schema is an instance of the client's; a few keywords are enforced
by allowing fewer instances (each rewriting below says which), and whatever has no such rewriting is refused.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

try:  # the regex parser, for a pattern's shortest and longest match
    from re import _parser as _sre_parse  # novermin - Python 3.11+
except ImportError:  # Python 3.10 (the GPU image)
    import sre_parse as _sre_parse

TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KEYWORDS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems")
OBJECT_KEYWORDS = ("properties", "patternProperties", "additionalProperties", "required", "minProperties",
                   "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies")
# The JSON type each group of keywords constrains (an instance of another type passes them).
KIND_OF = {**{k: "string" for k in STRING_KEYWORDS}, **{k: "number" for k in NUMBER_KEYWORDS},
           **{k: "array" for k in ARRAY_KEYWORDS}, **{k: "object" for k in OBJECT_KEYWORDS}}
# Formats xgrammar turns into grammar (xgrammar 0.2.8); any other format is an annotation, as JSON Schema allows.
GRAMMAR_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer"})
# Formats whose xgrammar rule allows what the format does not ("2023-02-31", a leap second at any minute, an octet
# "021", a raw '"' inside a JSON pointer, which breaks the JSON string): written as patterns instead that allow only
# valid values (every day of every month, but no 29 February; pointers without '"' or '\\').
_DAY = "(0[1-9]|1[0-9]|2[0-8])"
_DATE = (f"[1-9][0-9][0-9][0-9]-((0[13578]|1[02])-({_DAY[1:-1]}|29|30|31)|(0[469]|11)-({_DAY[1:-1]}|29|30)"
         f"|02-{_DAY})")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_POINTER = '(/([^~/"\\\\]|~[01])*)*'
FORMAT_PATTERNS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}",
                   "ipv4": "\\.".join([_OCTET] * 4), "json-pointer": _POINTER,
                   "relative-json-pointer": f"(0|[1-9][0-9]*)(#|{_POINTER})"}
MAX_ENUM_STEPS = 256  # multipleOf beside bounds: the multiples between them, written as an enum
MAX_EXACT_INT = 2**53 - 1  # integer bounds past this are brought within it
# Constraints no rewriting here can enforce, and why.
REFUSED = {
    "contains": "a grammar cannot require some item to match while the others are free",
    "unevaluatedItems": "it depends on what the other keywords evaluated",
    "unevaluatedProperties": "it depends on what the other keywords evaluated",
    "$dynamicRef": "dynamic references are not supported", "$recursiveRef": "dynamic references are not supported",
    "extends": "a draft-03 keyword (draft-04 and later are read)",
    "disallow": "a draft-03 keyword (draft-04 and later are read)",
    "divisibleBy": "a draft-03 keyword (draft-04 and later are read)",
}
DIALECTS = {"draft-04": 4, "draft-06": 6, "draft-07": 7, "2019-09": 2019, "2020-12": 2020}
# Schema-holding keys of every draft, for locating identifiers and `$ref` targets.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_VALUES = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties", "contentSchema")
# Where the client's schema sits, for resolving relative identifiers (never fetched).
_RETRIEVAL_URI = "https://client-schema.invalid/schema.json"
MAX_BRANCHES = 64  # anyOf branches after distributing a conjunction over them
# Rewriting runs in the caller's thread: past this many steps (subschemas read, merged, compared, written) a schema
# is refused rather than hold the thread. Of JSONSchemaBench's schemas within the 32 KiB cap the costliest took 2,544
# steps (27 ms on an AMD EPYC Zen 3 core); merging and oneOf comparisons can grow faster than the text.
MAX_STEPS = 20_000


@dataclass
class SchemaRefused(Exception):
    """A keyword the grammar cannot enforce: the keyword, its JSON pointer in the client's schema, and why."""
    keyword: str
    where: str
    why: str


@dataclass
class Unsatisfiable(Exception):
    """No instance satisfies this (sub)schema."""
    keyword: str
    where: str
    why: str = "no value can satisfy it"


class _CannotTell(Exception):
    """matches() met a keyword it cannot evaluate here (a pattern Python's re does not read)."""


def enforceable(schema: Any) -> Any:
    """The schema xgrammar enforces for `schema`: its instances are instances of `schema`. SchemaRefused names
    what cannot be enforced (or what no instance can satisfy)."""
    try:
        return _Rewriter(schema).run()
    except Unsatisfiable as e:
        raise SchemaRefused(e.keyword, e.where, f"no value can satisfy the schema ({e.why})") from None
    except RecursionError:
        raise SchemaRefused("<schema>", "", "it nests too deeply to be rewritten") from None


def _pointer(path: tuple) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _key(value: Any) -> str:
    """A value's identity under JSON equality (1 == 1.0; true != 1)."""
    if isinstance(value, float) and value.is_integer():  # novermin - float.is_integer, in every Python 3
        value = int(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):  # novermin - float.is_integer
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _has_type(types: list[str] | None, kind: str) -> bool:
    """Whether a schema of `types` (None: any) admits instances of `kind` (a keyword group's type)."""
    if types is None:
        return True
    return kind in types or (kind == "number" and "integer" in types) or (kind == "integer" and "number" in types)


def _search(pattern: str, text: str) -> bool:
    try:
        return re.search(pattern, text) is not None
    except re.error:
        raise _CannotTell(pattern) from None


@dataclass
class _Rewriter:
    root: Any
    dialect: int | None = None
    bases: dict[tuple, str] = field(default_factory=dict)  # every schema location -> its base URI
    resources: dict[str, tuple] = field(default_factory=dict)  # a resource's absolute URI -> its location
    anchors: dict[str, tuple] = field(default_factory=dict)  # uri#name -> location
    names: dict[tuple, str] = field(default_factory=dict)  # a $ref target's location -> its name in $defs
    cores: dict[str, Any] = field(default_factory=dict)  # name -> the target, rewritten (absent while rewriting)
    emitted: dict[str, Any] = field(default_factory=dict)  # name -> the target as xgrammar reads it (None: emitting)
    merging: set[tuple] = field(default_factory=set)  # references being merged (two recursive ones never end)
    steps: int = 0

    def _step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise SchemaRefused("<schema>", "", f"it is too large to rewrite: past {MAX_STEPS} steps (its "
                                                "subschemas, merges and oneOf comparisons)")

    def run(self) -> Any:
        self.dialect = self._dialect()
        self.resources[_RETRIEVAL_URI] = ()
        self._index(self.root, (), _RETRIEVAL_URI)
        body = self._emit(self._rewrite(self.root, ()), "")
        return {**body, "$defs": self.emitted} if self.emitted else body

    # ---- dialect and identifiers -------------------------------------------------------------------------
    def _dialect(self) -> int | None:
        uri = self.root.get("$schema") if isinstance(self.root, dict) else None
        if uri is None:
            return None
        if not isinstance(uri, str):
            raise SchemaRefused("$schema", "", "a URI naming a JSON Schema draft")
        if "draft-03" in uri or "draft-02" in uri or "draft-01" in uri:
            raise SchemaRefused("$schema", "", f"{uri!r}: drafts 04, 06, 07, 2019-09 and 2020-12 are read")
        return next((n for name, n in DIALECTS.items() if name in uri), None)  # another meta-schema: any draft

    def _identifier(self, node: dict) -> str | None:
        """`$id` from draft-06 on, `id` in draft-04 (each is an ordinary, ignored keyword in the other drafts)."""
        ident = node.get("$id") if self.dialect != 4 else None
        if ident is None and self.dialect in (None, 4):
            ident = node.get("id")
        return ident if isinstance(ident, str) else None

    def _index(self, node: Any, path: tuple, base: str) -> None:
        if not isinstance(node, dict):
            if node is True or node is False:
                self.bases[path] = base
            return
        ident = self._identifier(node)
        if ident is not None:
            uri, fragment = urldefrag(urljoin(base, ident))
            if not ident.startswith("#"):
                base = uri
                self.resources.setdefault(uri, path)
            if fragment and not fragment.startswith("/"):  # draft-06/07 `"$id": "#name"`: a plain-name anchor
                self.anchors.setdefault(f"{uri}#{unquote(fragment)}", path)
        if isinstance(node.get("$anchor"), str):
            self.anchors.setdefault(f"{base}#{node['$anchor']}", path)
        self.bases[path] = base
        for key, value in node.items():
            if key in ("enum", "const", "default", "examples"):
                continue  # data
            if key in _MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    if isinstance(sub, (dict, bool)):
                        self._index(sub, path + (key, name), base)
            elif key in _LISTS and isinstance(value, list):
                for i, sub in enumerate(value):
                    self._index(sub, path + (key, i), base)
            elif key in _VALUES and isinstance(value, (dict, bool)):
                self._index(value, path + (key,), base)

    def _resolve(self, ref: Any, path: tuple) -> tuple:
        """The location a `$ref` names (references outside the schema are refused: nothing is fetched)."""
        where = _pointer(path)
        if not isinstance(ref, str):
            raise SchemaRefused("$ref", where, "a URI reference (a string)")
        uri, fragment = urldefrag(urljoin(self.bases[path], ref))
        fragment = unquote(fragment)
        location = self.resources.get(uri)
        if location is None:
            raise SchemaRefused("$ref", where, f"{ref!r} names another document: allowed references inside the "
                                               "schema ('#/$defs/...', '#', an $id or $anchor it declares)")
        if fragment and not fragment.startswith("/"):
            location = self.anchors.get(f"{uri}#{fragment}")
            if location is None:
                raise SchemaRefused("$ref", where, f"{ref!r}: no $anchor or $id names {fragment!r}")
            return location
        for token in fragment.split("/")[1:]:
            token = token.replace("~1", "/").replace("~0", "~")
            try:
                node = self._node(location)
            except (KeyError, IndexError, TypeError):
                break
            location += (int(token) if isinstance(node, list) and token.isdigit() else token,)
        if location not in self.bases:
            raise SchemaRefused("$ref", where, f"{ref!r} does not point at a schema inside this one")
        return location

    def _node(self, path: tuple) -> Any:
        node = self.root
        for key in path:
            node = node[key]
        return node

    def _target(self, path: tuple) -> dict:
        """A `$ref` to `path`: {"$ref": name}, the target rewritten once (a recursive one finds its own name)."""
        if path not in self.names:
            base = re.sub(r"[^A-Za-z0-9_]", "_", str(path[-1]) if path else "root") or "def"
            name, i = base, 1
            while name in self.cores or name in self.names.values():
                name, i = f"{base}_{i}", i + 1
            self.names[path] = name
            try:
                self.cores[name] = self._rewrite(self._node(path), path)
            except BaseException:
                del self.names[path]
                raise
        return {"$ref": self.names[path]}

    def _deref(self, core: Any, where: str) -> Any:
        """A reference's target, to merge with its neighbours; refused inside the target's own definition."""
        while isinstance(core, dict) and "$ref" in core:
            if core["$ref"] not in self.cores:
                raise SchemaRefused("$ref", where, "a reference beside other keywords (or inside allOf) to a "
                                                   "definition that contains it cannot be merged")
            core = self.cores[core["$ref"]]
        return core

    # ---- reading one schema ---------------------------------------------------------------------------------
    def _rewrite(self, node: Any, path: tuple) -> Any:
        """The client's (sub)schema -> its meaning as a "core": True, False, or a dict of the enforced keywords
        (sub-schemas as cores), `anyOf` and `$ref` each alone in theirs."""
        self._step()
        where = _pointer(path)
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise SchemaRefused("<schema>", where, f"a schema is an object or a boolean, not {type(node).__name__}")
        for key, why in REFUSED.items():
            if key in node:
                raise SchemaRefused(key, where, why)
        if isinstance(node.get("required"), bool):
            raise SchemaRefused("required", where, "a boolean `required` is draft-03's: allowed a list of names")
        if "if" in node and ("then" in node or "else" in node):
            raise SchemaRefused("if", where, "a grammar cannot choose by a condition on the instance")
        try:
            if "$ref" in node and self.dialect in (4, 6, 7):
                try:  # both readings hold when the siblings can be merged; else the draft's own: siblings ignored
                    return self._conjunction(node, path)
                except (SchemaRefused, Unsatisfiable):
                    return self._target(self._resolve(node["$ref"], path))
            return self._conjunction(node, path)
        except Unsatisfiable:
            return False  # where it sits decides: an optional property is left out, a branch dropped

    def _conjunction(self, node: dict, path: tuple) -> Any:
        where = _pointer(path)
        core = self._own(node, path)
        for i, sub in enumerate(_list(node, "allOf", where)):
            core = self._merge(core, self._rewrite(sub, path + ("allOf", i)), f"{where}/allOf/{i}")
        if "$ref" in node:
            core = self._merge(core, self._target(self._resolve(node["$ref"], path)), where)
        core = self._dependencies(core, node, path)
        if "not" in node:
            core = self._not(core, self._rewrite(node["not"], path + ("not",)), f"{where}/not")
        if "anyOf" in node:
            branches = [self._rewrite(sub, path + ("anyOf", i)) for i, sub in enumerate(_list(node, "anyOf", where))]
            core = self._merge(core, {"anyOf": branches}, f"{where}/anyOf")
        if "oneOf" in node:
            branches = []
            for i, sub in enumerate(_list(node, "oneOf", where)):
                try:
                    branches.append(self._merge(core, self._rewrite(sub, path + ("oneOf", i)), f"{where}/oneOf/{i}"))
                except Unsatisfiable:
                    continue  # a branch nothing matches cannot make an instance match twice
            core = self._one_of(branches, f"{where}/oneOf")
        return core

    def _own(self, node: dict, path: tuple) -> Any:
        """The schema's own keywords (no applicators), as a core."""
        where = _pointer(path)
        core: dict[str, Any] = {}
        types = node.get("type")
        if types is not None:
            types = [types] if isinstance(types, str) else types
            if not isinstance(types, list) or not types or not all(t in TYPES for t in types):
                raise SchemaRefused("type", where, f"{node['type']!r}: allowed one of {', '.join(TYPES)} or a "
                                                   "non-empty list of them")
            core["type"] = sorted(set(types))
        values = None
        if "enum" in node:
            values = _list(node, "enum", where)
        if "const" in node:
            values = [v for v in (values if values is not None else [node["const"]]) if _key(v) == _key(node["const"])]
        if values is not None:
            if not values:
                raise Unsatisfiable("enum", where, "enum and const have no value in common")
            core["enum"] = values
        types = core.get("type")
        if _has_type(types, "string"):
            self._string(core, node, where)
        if _has_type(types, "number"):
            self._number(core, node, where)
        if _has_type(types, "array"):
            self._array(core, node, path)
        if _has_type(types, "object"):
            self._object(core, node, path)
        return core if core else True

    def _string(self, core: dict, node: dict, where: str) -> None:
        for key in ("minLength", "maxLength"):
            if key in node:
                core[key] = _count(node, key, where)
        if "pattern" in node:
            if not isinstance(node["pattern"], str):
                raise SchemaRefused("pattern", where, "a regular expression (a string)")
            core["pattern"] = node["pattern"]
        if isinstance(node.get("format"), str) and node["format"] in GRAMMAR_FORMATS:
            core["format"] = node["format"]

    def _number(self, core: dict, node: dict, where: str) -> None:
        for key in ("minimum", "maximum", "multipleOf"):
            if key in node:
                core[key] = _number(node, key, where)
        if "multipleOf" in core and core["multipleOf"] <= 0:
            raise SchemaRefused("multipleOf", where, "a number > 0")
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            value = node.get(key)
            if isinstance(value, bool):  # draft-04: a flag on minimum/maximum
                if value and bound in core:
                    core[key] = core.pop(bound)
            elif key in node:
                core[key] = _number(node, key, where)

    def _array(self, core: dict, node: dict, path: tuple) -> None:
        where = _pointer(path)
        items = node.get("items")
        if isinstance(items, list):  # drafts 04-2019-09: a tuple, then additionalItems for the rest
            core["prefixItems"] = [self._rewrite(s, path + ("items", i)) for i, s in enumerate(items)]
            if "additionalItems" in node:
                core["items"] = self._rewrite(node["additionalItems"], path + ("additionalItems",))
        else:
            if "prefixItems" in node:
                core["prefixItems"] = [self._rewrite(s, path + ("prefixItems", i))
                                       for i, s in enumerate(_list(node, "prefixItems", where))]
            if items is not None:
                core["items"] = self._rewrite(items, path + ("items",))
        for key in ("minItems", "maxItems"):
            if key in node:
                core[key] = _count(node, key, where)
        if node.get("uniqueItems") is True:
            core["uniqueItems"] = True

    def _object(self, core: dict, node: dict, path: tuple) -> None:
        where = _pointer(path)
        for key in ("properties", "patternProperties"):
            if key in node:
                value = node[key]
                if not isinstance(value, dict):
                    raise SchemaRefused(key, where, "an object of schemas")
                core[key] = {name: self._rewrite(sub, path + (key, name)) for name, sub in value.items()}
        for name in core.get("patternProperties", {}):
            try:
                re.compile(name)
            except re.error as e:
                raise SchemaRefused("patternProperties", where, f"{name!r} is not a regular expression ({e})") from None
        for key in ("additionalProperties", "propertyNames"):
            if key in node:
                core[key] = self._rewrite(node[key], path + (key,))
        required = node.get("required")
        if required is not None:
            if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
                raise SchemaRefused("required", where, "a list of property names")
            if required:
                core["required"] = list(dict.fromkeys(required))
        for key in ("minProperties", "maxProperties"):
            if key in node:
                core[key] = _count(node, key, where)

    # ---- combining ------------------------------------------------------------------------------------------
    def _merge(self, a: Any, b: Any, where: str) -> Any:
        """a AND b as one core (both must hold), or SchemaRefused where it cannot be written as one."""
        self._step()
        if a is True or b is False:
            return b
        if b is True or a is False:
            return a
        refs = (a.get("$ref"), b.get("$ref"))
        if refs != (None, None):
            if refs in self.merging:
                raise SchemaRefused("$ref", where, "merging recursive definitions with one another is not supported")
            self.merging.add(refs)
            try:
                return self._merge(self._deref(a, where), self._deref(b, where), where)
            finally:
                self.merging.discard(refs)
        if "anyOf" in a or "anyOf" in b:
            return self._distribute(a, b, where)
        out: dict[str, Any] = {}
        if "type" in a or "type" in b:
            out["type"] = _type_meet(a.get("type"), b.get("type"))
            if not out["type"]:
                raise Unsatisfiable("type", where, "no type is allowed by both")
        if "enum" in a or "enum" in b:
            out["enum"] = self._enum_meet(a, b, where)
        _merge_strings(out, a, b, where)
        _merge_numbers(out, a, b, where)
        self._merge_arrays(out, a, b, where)
        self._merge_objects(out, a, b, where)
        return out

    def _distribute(self, a: dict, b: dict, where: str) -> Any:
        """a AND (b1 OR b2 ...) = (a AND b1) OR (a AND b2) ...; branches nothing can satisfy are dropped."""
        left = a["anyOf"] if "anyOf" in a else [a]
        right = b["anyOf"] if "anyOf" in b else [b]
        if len(left) * len(right) > MAX_BRANCHES:
            raise SchemaRefused("anyOf", where, f"merging it with its neighbours gives {len(left) * len(right)} "
                                                f"branches: allowed at most {MAX_BRANCHES}")
        branches = []
        for x in left:
            for y in right:
                try:
                    merged = self._merge(x, y, where)
                except Unsatisfiable:
                    continue
                branches += merged["anyOf"] if isinstance(merged, dict) and "anyOf" in merged else [merged]
        if not branches:
            raise Unsatisfiable("anyOf", where, "no branch is satisfiable beside its neighbours")
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def _enum_meet(self, a: dict, b: dict, where: str) -> list:
        if "enum" in a and "enum" in b:
            keys = {_key(v) for v in b["enum"]}
            values = [v for v in a["enum"] if _key(v) in keys]
        else:
            values = a.get("enum", b.get("enum"))
        if not values:
            raise Unsatisfiable("enum", where, "the enums have no value in common")
        return values

    def _merge_arrays(self, out: dict, a: dict, b: dict, where: str) -> None:
        if "prefixItems" in a or "prefixItems" in b:
            pa, pb = a.get("prefixItems", []), b.get("prefixItems", [])
            ia, ib = a.get("items", True), b.get("items", True)
            out["prefixItems"] = [self._merge(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib, where)
                                  for i in range(max(len(pa), len(pb)))]
        if "items" in a or "items" in b:
            out["items"] = self._merge(a.get("items", True), b.get("items", True), where)
        _tighten(out, a, b, "minItems", max)
        _tighten(out, a, b, "maxItems", min)
        if a.get("uniqueItems") or b.get("uniqueItems"):
            out["uniqueItems"] = True

    def _merge_objects(self, out: dict, a: dict, b: dict, where: str) -> None:
        """Exact: a named property meets what each side says of that name (its property, the patterns matching
        it, else its additionalProperties); other names meet both sides' additionalProperties."""
        pa, pb = a.get("patternProperties", {}), b.get("patternProperties", {})
        if (pa and (pb or "additionalProperties" in b)) or (pb and "additionalProperties" in a):
            raise SchemaRefused("patternProperties", where, "merging it with another object schema's "
                                                            "patternProperties or additionalProperties is not "
                                                            "supported")
        names = list(dict.fromkeys([*a.get("properties", {}), *b.get("properties", {})]))
        if names:
            out["properties"] = {n: self._merge(self._value_of(a, n, where), self._value_of(b, n, where), where)
                                 for n in names}
        if pa or pb:
            out["patternProperties"] = {**pa, **pb}
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = self._merge(a.get("additionalProperties", True),
                                                      b.get("additionalProperties", True), where)
        if "propertyNames" in a or "propertyNames" in b:
            out["propertyNames"] = self._merge(a.get("propertyNames", True), b.get("propertyNames", True), where)
        required = list(dict.fromkeys([*a.get("required", []), *b.get("required", [])]))
        if required:
            out["required"] = required
        _tighten(out, a, b, "minProperties", max)
        _tighten(out, a, b, "maxProperties", min)

    def _value_of(self, core: dict, name: str, where: str) -> Any:
        """What `core` requires of a property called `name`, if present (True when `core` is not an object
        schema's: then it says nothing of properties)."""
        value = core.get("properties", {}).get(name, True)
        matched = False
        for pattern, sub in core.get("patternProperties", {}).items():
            if _search(pattern, name):
                value, matched = self._merge(value, sub, where), True
        if name not in core.get("properties", {}) and not matched:
            value = self._merge(value, core.get("additionalProperties", True), where)
        return value

    def _dependencies(self, core: Any, node: dict, path: tuple) -> Any:
        """dependentRequired / dependentSchemas (and draft-04-07's dependencies): when a property is present,
        others must be, or the instance must satisfy a schema. Enforced by requiring them (or applying the schema)
        whether or not it is present; where that cannot hold, by leaving the property out."""
        where = _pointer(path)
        deps: list[tuple[str, Any, tuple]] = []
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            value = node.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise SchemaRefused(key, where, "an object of property names")
            deps += [(name, sub, path + (key, name)) for name, sub in value.items()]
        for name, then, sub_path in deps:
            if isinstance(core, dict) and core.get("properties", {}).get(name) is False:
                continue  # never present
            if isinstance(then, list):
                if not all(isinstance(n, str) for n in then):
                    raise SchemaRefused("dependencies", where, f"{name!r}: a list of property names or a schema")
                then_core: Any = {"required": then} if then else True
            else:
                then_core = self._rewrite(then, sub_path)
            try:
                core = self._merge(core, then_core, where)
            except (Unsatisfiable, SchemaRefused):
                if isinstance(core, dict) and name in core.get("required", []):
                    raise
                core = self._merge(core, {"properties": {name: False}}, where)
        return core

    def _not(self, core: Any, negated: Any, where: str) -> Any:
        """core AND NOT negated, for the negations that have a positive form: not {} (nothing), not a type, not
        a set of required names (one of them is left out: the one the rest of the schema does not require),
        not an enum beside an enum."""
        if negated is True:
            raise Unsatisfiable("not", where, "not {} allows nothing")
        if negated is False:
            return core
        negated = self._deref(negated, where)
        if isinstance(negated, dict) and "anyOf" in negated:
            for branch in negated["anyOf"]:
                core = self._not(core, branch, where)
            return core
        keys = set(negated)
        if keys == {"type"}:
            banned = negated["type"]
            # "a number but not an integer" has no grammar here: numbers go altogether then (fewer instances)
            allowed = [t for t in _types_of(core) or TYPES if t not in banned and not (
                t in ("number", "integer") and ("number" in banned or "integer" in banned))]
            return self._merge(core, {"type": allowed} if allowed else False, where)
        if keys <= {"type", "required"} and "required" in negated and negated.get("type", ["object"]) == ["object"]:
            required = core.get("required", []) if isinstance(core, dict) else []
            left_out = next((n for n in negated["required"] if n not in required), None)
            if left_out is None:
                raise Unsatisfiable("not", where, "every name it requires is required")
            absent: dict[str, Any] = {"properties": {left_out: False}}
            return self._merge(core, absent if "type" in negated else {"type": ["object"], **absent}, where)
        if keys <= {"type", "enum"} and "enum" in negated and isinstance(core, dict) and "enum" in core:
            values = [v for v in core["enum"] if not self._matches(v, negated)]
            return self._merge(core, {"enum": values} if values else False, where)
        raise SchemaRefused("not", where, "only not {}, not a type, not a set of required names and not an enum "
                                          "beside an enum can be enforced")

    def _one_of(self, branches: list, where: str) -> Any:
        """Exactly one branch: a grammar only offers "at least one", so each branch is kept from matching the
        others: proved apart (types, enums, a required property of distinct values), or made so by leaving out a
        property another branch requires. Else refused."""
        if not branches:
            raise Unsatisfiable("oneOf", where, "no branch is satisfiable")
        kept = []
        for i, branch in enumerate(branches):
            for j, other in enumerate(branches):
                if j != i and not self._disjoint(branch, other, where):
                    branch = self._excluding(branch, other, where, f"{i} and {j}")
            kept.append(branch)
        return kept[0] if len(kept) == 1 else {"anyOf": kept}

    def _excluding(self, core: Any, other: Any, where: str, pair: str) -> Any:
        core, other = self._deref(core, where), self._deref(other, where)
        if isinstance(core, dict) and "anyOf" in core:
            return {"anyOf": [self._excluding(b, other, where, pair) for b in core["anyOf"]]}
        objects_only = _types_of(core) == ["object"] or _types_of(other) == ["object"]
        required = core.get("required", []) if isinstance(core, dict) else []
        theirs = other.get("required", []) if isinstance(other, dict) else []
        # A property the other requires, left out here; or one whose values here the other never allows, required.
        left_out = next((n for n in theirs if n not in required), None)
        if objects_only and left_out is not None:
            return self._merge(core, {"properties": {left_out: False}}, where)
        if _types_of(core) == ["object"]:
            for name in core.get("properties", {}):
                if name not in required and self._disjoint(self._value_of(core, name, where),
                                                           self._value_of(other, name, where), where):
                    return self._merge(core, {"required": [name]}, where)
        raise SchemaRefused("oneOf", where, f"branches {pair} may both match one instance: a grammar enforces "
                                            "'at least one', so oneOf needs branches told apart by type, enum or a "
                                            "property one has and the other may not have")

    def _disjoint(self, a: Any, b: Any, where: str) -> bool:
        """True only when no instance matches both (False: they may overlap, or it cannot be told)."""
        try:
            return self._apart(a, b, where)
        except (SchemaRefused, Unsatisfiable, _CannotTell):
            return False

    def _apart(self, a: Any, b: Any, where: str) -> bool:
        self._step()
        if a is False or b is False:
            return True
        if a is True or b is True:
            return False
        a, b = self._settled(a, where), self._settled(b, where)
        if isinstance(a, bool) or isinstance(b, bool):
            return a is False or b is False
        if "anyOf" in a:
            return all(self._apart(x, b, where) for x in a["anyOf"])
        if "anyOf" in b:
            return all(self._apart(a, y, where) for y in b["anyOf"])
        ta, tb = _types_of(a), _types_of(b)
        if ta is not None and tb is not None and not _type_meet(ta, tb):
            return True
        for x, y in ((a, b), (b, a)):
            if "enum" in x and not any(self._may_match(v, y) for v in x["enum"]):
                return True
        if ta == ["object"] and tb == ["object"]:
            # a property one requires, with a value the other never allows there (or never allows at all)
            for x, y in ((a, b), (b, a)):
                for name in x.get("required", []):
                    if self._apart(self._value_of(x, name, where), self._value_of(y, name, where), where):
                        return True
        return False

    def _settled(self, core: Any, where: str) -> Any:
        """A reference's target; for one still being rewritten (a recursive definition), what its `type` says."""
        if isinstance(core, dict) and "$ref" in core and core["$ref"] not in self.cores:
            path = next(p for p, n in self.names.items() if n == core["$ref"])
            types = _sketch_types(self._node(path))
            return {"type": types} if types else True
        return self._deref(core, where)

    def _may_match(self, value: Any, core: Any) -> bool:
        try:
            return self._matches(value, core)
        except _CannotTell:
            return True

    def _matches(self, value: Any, core: Any) -> bool:
        """Does `value` satisfy `core`? (formats are annotations here; _CannotTell for a pattern re cannot read)"""
        self._step()
        if isinstance(core, bool):
            return core
        if "$ref" in core:
            target = self.cores.get(core["$ref"])
            if target is None:
                raise _CannotTell(core["$ref"])
            return self._matches(value, target)
        if "anyOf" in core:
            return any(self._matches(value, b) for b in core["anyOf"])
        kind = _json_type(value)
        if "type" in core and not (kind in core["type"] or (kind == "integer" and "number" in core["type"])):
            return False
        if "enum" in core and _key(value) not in {_key(v) for v in core["enum"]}:
            return False
        if kind == "string":
            return _string_ok(value, core)
        if kind in ("integer", "number"):
            return _number_ok(value, core)
        if kind == "array":
            return self._array_ok(value, core)
        if kind == "object":
            return self._object_ok(value, core)
        return True

    def _array_ok(self, value: list, core: dict) -> bool:
        if not core.get("minItems", 0) <= len(value) <= core.get("maxItems", math.inf):
            return False
        if core.get("uniqueItems") and len({_key(v) for v in value}) != len(value):
            return False
        prefix = core.get("prefixItems", [])
        return all(self._matches(v, prefix[i] if i < len(prefix) else core.get("items", True))
                   for i, v in enumerate(value))

    def _object_ok(self, value: dict, core: dict) -> bool:
        if not core.get("minProperties", 0) <= len(value) <= core.get("maxProperties", math.inf):
            return False
        if any(name not in value for name in core.get("required", [])):
            return False
        props, patterns = core.get("properties", {}), core.get("patternProperties", {})
        for name, item in value.items():
            if not self._matches(name, core.get("propertyNames", True)):
                return False
            if name in props and not self._matches(item, props[name]):
                return False
            matched = [sub for pattern, sub in patterns.items() if _search(pattern, name)]
            if not all(self._matches(item, sub) for sub in matched):
                return False
            if name not in props and not matched and not self._matches(item, core.get("additionalProperties", True)):
                return False
        return True

    # ---- writing the schema xgrammar reads ---------------------------------------------------------------
    def _emit(self, core: Any, where: str) -> Any:
        """A core -> xgrammar's JSON schema, whose grammar allows exactly its instances or fewer. `where`: the
        place in the written schema, for refusals."""
        self._step()
        if core is True:
            return {}
        if core is False:
            raise Unsatisfiable("<schema>", where, "a false schema")
        if "$ref" in core:
            return self._emit_ref(core["$ref"])
        if "anyOf" in core:
            branches = []
            for i, branch in enumerate(core["anyOf"]):
                try:
                    branches.append(self._emit(branch, f"{where}/anyOf/{i}"))
                except Unsatisfiable:
                    continue
            if not branches:
                raise Unsatisfiable("anyOf", where, "no branch is satisfiable")
            return branches[0] if len(branches) == 1 else {"anyOf": branches}
        if "enum" in core:
            return self._emit_enum(core, where)
        # A keyword of one type without a type: instances of the other types are left out.
        types = core.get("type") or sorted({KIND_OF[k] for k in core if k in KIND_OF}) or None
        step = None
        if "multipleOf" in core and _has_type(types, "number"):
            step = _integer_step(core["multipleOf"], where)
            types = sorted({"integer" if t == "number" else t for t in types})
        out: dict[str, Any] = {}
        if types is not None:
            kept = [t for t in types if not (t == "integer" and "number" in types)]
            out["type"] = kept[0] if len(kept) == 1 else kept
        if _has_type(types, "string"):
            _emit_string(out, core, where)
        if _has_type(types, "number"):
            _emit_number(out, core, types, step, where)
        if _has_type(types, "array"):
            self._emit_array(out, core, where)
        if _has_type(types, "object"):
            self._emit_object(out, core, where)
        return out

    def _emit_ref(self, name: str) -> dict:
        """A reference, its target written once into $defs (a target that refers to itself is under way)."""
        if name not in self.emitted:
            where = _pointer(next(p for p, n in self.names.items() if n == name))
            self.emitted[name] = None
            try:
                self.emitted[name] = self._emit(self.cores[name], where)
            except BaseException:
                del self.emitted[name]
                raise
        return {"$ref": f"#/$defs/{name}"}

    @staticmethod
    def _enough_required(core: dict, named: dict, required: list[str], where: str) -> list[str]:
        """minProperties met by requiring named properties first (fewer instances). xgrammar may write one generated
        key twice, which a JSON reader keeps once, so generated keys are trusted for one property at most."""
        wanted = core.get("minProperties", 0)
        required = [n for n in required if n in named] + [n for n in named if n not in required][
            :max(0, wanted - len(required))]
        if wanted > len(required) + 1:
            raise SchemaRefused("minProperties", where, f"{wanted} properties where {len(required)} are named: "
                                                        "allowed at most one more than the named properties")
        return required

    def _emit_enum(self, core: dict, where: str) -> dict:
        rest = {k: v for k, v in core.items() if k != "enum"}
        try:
            values = [v for v in core["enum"] if self._matches(v, rest)]
        except _CannotTell as e:
            raise SchemaRefused("enum", where, f"cannot tell which values the keywords beside it allow ({e})") from None
        if not values:
            raise Unsatisfiable("enum", where, "no enum value satisfies the keywords beside it")
        return {"const": values[0]} if len(values) == 1 else {"enum": values}

    def _emit_array(self, out: dict, core: dict, where: str) -> None:
        """uniqueItems: a grammar cannot compare items, so at most one item is allowed (refused where more are
        required). An item position nothing satisfies ends the array there."""
        min_items, max_items = core.get("minItems", 0), core.get("maxItems")
        prefix = core.get("prefixItems", [])
        if core.get("uniqueItems") and (max_items is None or max_items > 1):
            if min_items > 1 or len(prefix) > 1:
                raise SchemaRefused("uniqueItems", where, "a grammar cannot keep items distinct; allowed where at "
                                                          "most one item is needed (minItems <= 1)")
            max_items = 1
        if prefix:
            out["prefixItems"] = []
            for i, sub in enumerate(prefix):
                try:
                    out["prefixItems"].append(self._emit(sub, f"{where}/prefixItems/{i}"))
                except Unsatisfiable:
                    if i < min_items:
                        raise
                    max_items = i if max_items is None else min(max_items, i)
                    break
        if "items" in core:
            try:
                out["items"] = self._emit(core["items"], f"{where}/items")
            except Unsatisfiable:
                if min_items > len(out.get("prefixItems", [])):
                    raise
                out["items"] = False
        elif not prefix or min_items > len(prefix):
            out["items"] = {}  # items are free where none are named (xgrammar's strict mode would allow none)
        if min_items:
            out["minItems"] = min_items
        if max_items is not None:
            out["maxItems"] = max_items

    def _emit_object(self, out: dict, core: dict, where: str) -> None:
        """Named properties meet the patterns matching them, and required names missing from `properties` get
        what the object says of other names (xgrammar would leave them out). Generated objects carry only their
        named properties unless additionalProperties says otherwise (xgrammar's strict mode); patternProperties
        generate keys only when one pattern is alone and matches no named property, else the object is closed to
        its named properties (fewer instances, each valid)."""
        patterns = core.get("patternProperties", {})
        required = core.get("required", [])
        names = core.get("propertyNames", True)
        named: dict[str, Any] = {}
        left_out = False
        try:
            for name in [*core.get("properties", {}), *(n for n in required if n not in core.get("properties", {}))]:
                try:
                    if not self._matches(name, names):
                        raise Unsatisfiable("propertyNames", where, f"{name!r} does not match propertyNames")
                    named[name] = self._emit(self._value_of(core, name, where), f"{where}/properties/{name}")
                except Unsatisfiable:
                    if name in required:
                        raise
                    left_out = True
            keep_pattern = (len(patterns) == 1 and core.get("additionalProperties", False) is False
                            and names is True and not left_out and _key_safe(next(iter(patterns)))
                            and not any(_search(p, n) for p in patterns for n in named))
        except _CannotTell as e:
            raise SchemaRefused("patternProperties" if patterns else "propertyNames", where,
                                f"cannot tell which property names the pattern {e} matches") from None
        required = self._enough_required(core, named, required, where)
        if named:
            out["properties"] = named
        if required:
            out["required"] = required
        addl = core.get("additionalProperties")
        if addl is None and core.get("minProperties", 0) > len(named):
            addl = True  # other names are free (xgrammar's strict mode would allow none)
        if keep_pattern:
            pattern, sub = next(iter(patterns.items()))
            value = self._emit(sub, f"{where}/patternProperties/{pattern}")
            try:
                out["patternProperties"] = {grammar_pattern(pattern): value}
            except ValueError as e:
                raise SchemaRefused("patternProperties", where, str(e)) from None
        if (patterns and not keep_pattern) or (left_out and addl not in (None, False)):
            out["additionalProperties"] = False
        elif addl is not None:
            try:
                out["additionalProperties"] = addl if addl is True else \
                    self._emit(addl, f"{where}/additionalProperties")
            except Unsatisfiable:
                out["additionalProperties"] = False
            if names is not True and out["additionalProperties"] is not False:
                out["propertyNames"] = self._emit(names, f"{where}/propertyNames")
                if not _key_safe(out["propertyNames"].get("pattern", "")):
                    out.pop("propertyNames")
                    out["additionalProperties"] = False
        for key in ("minProperties", "maxProperties"):
            if key in core:
                out[key] = core[key]


def _key_safe(pattern: str) -> bool:
    """Whether xgrammar can generate object keys from `pattern`: it writes a '"' that `.` or a negated class
    allows into a key unescaped (the key then breaks the JSON); patterns without either are safe."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            if pattern[i + 1:i + 2] == "^":
                return False
            in_class = True
        elif c == ".":
            return False
        i += 1
    return True


def _sketch_types(node: Any) -> list[str] | None:
    """The types a schema's own `type` (or its anyOf/oneOf branches' types) allows, read from the client's text;
    None: any."""
    if not isinstance(node, dict):
        return None
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        return sorted(t for t in types if t in TYPES) or None
    for key in ("anyOf", "oneOf"):
        branches = [_sketch_types(b) for b in node.get(key, [])] if isinstance(node.get(key), list) else []
        if branches and all(branches):
            return sorted({t for b in branches for t in b})
    return None


def _list(node: dict, key: str, where: str) -> list:
    value = node.get(key, [])
    if not isinstance(value, list):
        raise SchemaRefused(key, where, "a list")
    return value


def _count(node: dict, key: str, where: str) -> int:
    value = node[key]
    if isinstance(value, float) and value.is_integer():  # novermin - float.is_integer, in every Python 3
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemaRefused(key, where, f"{value!r}: allowed an integer >= 0")
    return value


def _number(node: dict, key: str, where: str) -> int | float:
    value = node[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise SchemaRefused(key, where, f"{value!r}: allowed a finite number")
    return value


def _types_of(core: Any) -> list[str] | None:
    return core.get("type") if isinstance(core, dict) else None


def _type_meet(a: list[str] | None, b: list[str] | None) -> list[str]:
    """The types both allow (None: any); an integer is a number."""
    a, b = a or list(TYPES), b or list(TYPES)
    out = {t for t in a if t in b}
    if "number" in a and "integer" in b or "integer" in a and "number" in b:
        out.add("integer")
    return sorted(out)


def _tighten(out: dict, a: dict, b: dict, key: str, pick: Any) -> None:
    values = [x[key] for x in (a, b) if key in x]
    if values:
        out[key] = pick(values)


def _merge_strings(out: dict, a: dict, b: dict, where: str) -> None:
    _tighten(out, a, b, "minLength", max)
    _tighten(out, a, b, "maxLength", min)
    for key in ("pattern", "format"):
        values = {x[key] for x in (a, b) if key in x}
        if len(values) > 1:
            raise SchemaRefused(key, where, f"two {key}s must both hold (allOf, or $ref beside other keywords): a "
                                            "grammar takes one")
        if values:
            out[key] = values.pop()


def _merge_numbers(out: dict, a: dict, b: dict, where: str) -> None:
    for inclusive, exclusive, pick in (("minimum", "exclusiveMinimum", max), ("maximum", "exclusiveMaximum", min)):
        bounds = [(x[inclusive], False) for x in (a, b) if inclusive in x] + \
                 [(x[exclusive], True) for x in (a, b) if exclusive in x]
        if bounds:
            value = pick(v for v, _ in bounds)
            is_exclusive = any(ex for v, ex in bounds if v == value)
            out[exclusive if is_exclusive else inclusive] = value
    steps = {x["multipleOf"] for x in (a, b) if "multipleOf" in x}
    if len(steps) > 1:
        small, large = sorted(steps)
        if Fraction(str(large)) % Fraction(str(small)) != 0:
            raise SchemaRefused("multipleOf", where, "two multipleOf that do not divide one another")
        steps = {large}
    if steps:
        out["multipleOf"] = steps.pop()


def _emit_string(out: dict, core: dict, where: str) -> None:
    if "pattern" in core and "format" in core:
        raise SchemaRefused("format", where, "beside pattern: the grammar follows one of them")
    out.update({k: core[k] for k in STRING_KEYWORDS if k in core})
    if core.get("format") in FORMAT_PATTERNS:
        length = next((k for k in ("maxLength", "minLength") if k in core), None)
        if length is not None:  # as grammar/cost.py says of any format or pattern
            raise SchemaRefused(length, where, "beside 'format': the grammar would not enforce the length; allowed: "
                                               "no length beside the format")
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    if "pattern" in out:
        try:
            out["pattern"] = grammar_pattern(out["pattern"])
        except ValueError as e:
            raise SchemaRefused("pattern", where, str(e)) from None
        _drop_lengths_the_pattern_meets(out, where)


def _drop_lengths_the_pattern_meets(out: dict, where: str) -> None:
    """xgrammar drops minLength/maxLength beside a pattern (grammar/cost.py refuses them then). Where every string
    the pattern matches whole (xgrammar writes whole matches) already has an allowed length, they say nothing more
    and are left out; where the pattern is one character class repeated, they become its repetition's bounds."""
    if "minLength" not in out and "maxLength" not in out:
        return
    try:
        shortest, longest = _sre_parse.parse(out["pattern"]).getwidth()
    except (re.error, OverflowError, RecursionError, ValueError):  # not a regex Python reads: stays as written
        return
    low, high = out.get("minLength", 0), out.get("maxLength", math.inf)
    if shortest >= low and longest <= high:
        out.pop("minLength", None)
        out.pop("maxLength", None)
        return
    # One character class repeated ("^[a-z0-9-]+$"): the lengths go into its repetition.
    one = _ONE_CLASS_REPEATED.match(out["pattern"])
    if one is None:
        return
    start, item, quantifier, end = one.groups()
    q_low, comma, q_high = quantifier.strip("{}").partition(",") if quantifier[0] == "{" else ("", "", "")
    least = {"+": 1, "*": 0}.get(quantifier, int(q_low or 0))
    most = math.inf if quantifier in ("+", "*") or (comma and not q_high) else int(q_high or q_low)
    least, most = max(least, low), min(most, high)
    if least > most:
        raise Unsatisfiable("pattern", where, f"its repetition allows no length in [{low}, {high}]")
    out["pattern"] = f"{start}{item}{{{least},{'' if most == math.inf else most}}}{end}"
    out.pop("minLength", None)
    out.pop("maxLength", None)


# A pattern that is one character class (or escape, or plain character) under one quantifier, anchors optional.
_ONE_CLASS_REPEATED = re.compile(r"^(\^?)(\[(?:\\.|[^\]\\])+\]|\\[^\d]|[^\\\[\](){}|?*+^$.])"
                                 r"(\+|\*|\{\d+(?:,\d*)?\})(\$?)$")


# Escapes whose sets differ between ECMA-262 (JSON Schema's and xgrammar's reading) and Python's re (the jsonschema
# package's): a negated one written as printable ASCII, so that both read the same (fewer characters).
_ASCII_SETS = {"D": r"\x20\x21\x23-\x2f\x3a-\x5b\x5d-\x7e",
               "W": r"\x20\x21\x23-\x2f\x3a-\x40\x5b\x5d\x5e\x60\x7b-\x7e",
               "S": r"\x21\x23-\x5b\x5d-\x7e", "s": r"\x20"}
_CONTROL_ESCAPES = set("tnrfv0c")


def _escaped_code(pattern: str, i: int) -> int | None:
    r"""The code point of a \xHH or \uHHHH escape at pattern[i] (the backslash), else None."""
    size = {"x": 2, "u": 4}.get(pattern[i + 1:i + 2])
    digits = pattern[i + 2:i + 2 + size] if size else ""
    return int(digits, 16) if size and len(digits) == size and all(c in "0123456789abcdefABCDEF" for c in digits) \
        else None


def grammar_pattern(pattern: str) -> str:
    r"""A schema's pattern as xgrammar enforces it inside a JSON string, or ValueError(why) where it cannot.

    xgrammar 0.2.8 writes a pattern's literal quote, backslash and control characters into the JSON string as they
    are (the string breaks, or a backslash and a b read as a backspace): refused where the pattern would produce
    one. It turns an
    optional group holding a loop into a wrong automaton (`^(a+b)?c$` let "ac" through): a group's `?` is written
    `{0,1}`, the same language. \D, \W, \S and \s are written as printable ASCII sets (fewer characters), which
    ECMA-262 and Python read alike."""
    out: list[str] = []
    i, in_class, negated = 0, False, False
    while i < len(pattern):
        c = pattern[i]
        literal_ok = in_class and negated  # a character a negated class names is one it leaves out
        if c == "\\":
            nxt = pattern[i + 1:i + 2]
            code = _escaped_code(pattern, i)
            width = 2 + {"x": 2, "u": 4}.get(nxt, 0) if code is not None else 2
            if not literal_ok and (nxt in _CONTROL_ESCAPES or nxt in '"\\' or code is not None and
                                   (code < 0x20 or code in (0x22, 0x5C))):
                raise ValueError(f"it writes {pattern[i:i + width]!r} into the JSON string unescaped")
            if nxt in _ASCII_SETS and not literal_ok:
                out.append(_ASCII_SETS[nxt] if in_class else f"[{_ASCII_SETS[nxt]}]")
            else:
                out.append(pattern[i:i + width])
            i += width
            continue
        if (c == '"' or ord(c) < 0x20) and not literal_ok:
            raise ValueError(f"it writes {c!r} into the JSON string unescaped")
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, negated = True, pattern[i + 1:i + 2] == "^"
            start = i + 1 + negated
            if pattern[start:start + 1] == "]":  # a "]" first in a class is a character
                start += 1
            out.append(pattern[i:start])
            i = start
            continue
        elif c == "?" and out and out[-1] == ")":
            c = "{0,1}"
        out.append(c)
        i += 1
    return "".join(out)


def _integer_step(step: int | float, where: str) -> int | None:
    """multipleOf as a whole step on integers: a whole step stays; one that divides 1 (0.5, 0.01) is met by every
    integer (None); others are refused. Either way the value becomes an integer (a multiple of a whole step is
    one; for the others, fewer instances)."""
    ratio = Fraction(str(step))
    if ratio.denominator == 1:
        return int(ratio) if ratio != 1 else None
    if ratio.numerator == 1:
        return None
    raise SchemaRefused("multipleOf", where, f"{step!r}: allowed a whole number, or one that divides 1 (0.5, 0.01: "
                                             "the value is then a whole number)")


def _emit_number(out: dict, core: dict, types: list[str] | None, step: int | None, where: str) -> None:
    """Bounds as one value a side; for integers, inclusive whole bounds (xgrammar refuses fractional ones)."""
    if types is not None and "integer" in types and "number" not in types:
        low = _int_bound(core, "minimum", "exclusiveMinimum", math.ceil, 1)
        high = _int_bound(core, "maximum", "exclusiveMaximum", math.floor, -1)
        # Within what xgrammar reads exactly (a double's 53 bits; it refuses larger bounds): fewer instances.
        low = None if low is None else max(low, -MAX_EXACT_INT)
        high = None if high is None else min(high, MAX_EXACT_INT)
        if low is not None and high is not None and low > high:
            raise Unsatisfiable("minimum", where, "no integer lies between the bounds")
        if low is not None:
            out["minimum"] = low
        if high is not None:
            out["maximum"] = high
    else:  # the tighter bound a side, one keyword each
        bounds: dict[str, Any] = {}
        _merge_numbers(bounds, {k: v for k, v in core.items() if k != "multipleOf"}, {}, where)
        out.update(bounds)
    if step is not None and any(k in out for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        # xgrammar 0.2.8 enforces multipleOf or the bounds, not both (maximum 99, multipleOf 10 gave 14)
        low, high = out.get("minimum"), out.get("maximum")
        if low is None or high is None or (high - low) // step > MAX_ENUM_STEPS or set(types) != {"integer"}:
            raise SchemaRefused("multipleOf", where, f"beside minimum/maximum: allowed where they hold at most "
                                                     f"{MAX_ENUM_STEPS} multiples of a whole step (then written "
                                                     "as an enum)")
        first = -(-low // step) * step
        values = list(range(first, high + 1, step))
        if not values:
            raise Unsatisfiable("multipleOf", where, "no multiple lies between the bounds")
        out.clear()
        out["enum"] = values
    elif step is not None:
        out["multipleOf"] = step


def _int_bound(core: dict, inclusive: str, exclusive: str, rounding: Any, past: int) -> int | None:
    """The tightest whole bound (past: +1 for a lower bound, -1 for an upper one)."""
    bounds = []
    if inclusive in core:
        bounds.append(int(rounding(Fraction(str(core[inclusive])))))
    if exclusive in core:
        value = Fraction(str(core[exclusive]))
        bounds.append(int(value) + past if value.denominator == 1 else int(rounding(value)))
    if not bounds:
        return None
    return max(bounds) if past > 0 else min(bounds)


def _string_ok(value: str, core: dict) -> bool:
    if not core.get("minLength", 0) <= len(value) <= core.get("maxLength", math.inf):
        return False
    return "pattern" not in core or _search(core["pattern"], value)


def _number_ok(value: int | float, core: dict) -> bool:
    if "minimum" in core and value < core["minimum"] or "maximum" in core and value > core["maximum"]:
        return False
    if "exclusiveMinimum" in core and value <= core["exclusiveMinimum"]:
        return False
    if "exclusiveMaximum" in core and value >= core["exclusiveMaximum"]:
        return False
    return "multipleOf" not in core or Fraction(str(value)) % Fraction(str(core["multipleOf"])) == 0
