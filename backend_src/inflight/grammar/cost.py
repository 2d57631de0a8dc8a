"""What a grammar will cost xgrammar to compile, told from its text before compiling: cheap specs take the compile
worker kept for them, costly ones the other, and what would cost more than any request should is refused by name.

What is costly was measured (SmolLM2's 49k vocabulary, xgrammar 0.2.8, one AMD EPYC Zen 3 core, family 25
model 1; perf/probes/grammar_compile.py, docs/structured_output.md): a bounded repetition of a character class is
compiled position by position against the whole vocabulary. A JSON string with maxLength 16 costs 0.15 s of CPU,
32 0.4 s, 64 1.05 s, 128 2.5 s, and 256 or 512 ~3 s (the cost stops growing); a regex `[^x]{0,50}` 0.7 s,
`.{0,100}` 3 s. Distinct bounds add up (eight strings of maxLength 64..71: 10.7 s; sixteen of 16..31: 4.9 s);
equal ones are compiled once, so four strings of maxLength 255 cost what one does. Everything else measured
(objects, enums, numbers with ranges, arrays with minItems/maxItems, `pattern` inside a schema, literal repetitions
like `(ab|cd){60}`) costs milliseconds. A unit below is one position of such a repetition, up to PLATEAU per
repetition: roughly 20 ms of that core each.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..fields import InvalidRequestError
from .schema_check import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES

# Past this many positions a repetition costs little more (xgrammar changes how it holds it).
PLATEAU = 128
# At most this much cheap work goes to the worker kept for cheap compiles (about 0.15 s on the core above).
LIGHT_UNITS = 16
# Refused by name above this: two plateaued repetitions, about 6 s of one core, under the default 10 s timeout.
MAX_UNITS = 2 * PLATEAU

# A counted repetition in a regex, EBNF or Lark text: {n}, {m,}, {m,n}.
_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}")


@dataclass
class CompileCost:
    """The costly parts of a spec: (where, what, units) each, equal repetitions counted once."""
    parts: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def units(self) -> int:
        return sum(units for _, _, units in self.parts)

    @property
    def is_light(self) -> bool:
        return self.units <= LIGHT_UNITS


def _units(bound: int) -> int:
    return min(bound, PLATEAU)


def regex_cost(text: str, where: str = "") -> CompileCost:
    """Counted repetitions of a regex or grammar text; each distinct bound once (xgrammar shares equal ones)."""
    seen: dict[int, str] = {}
    for match in _COUNTED.finditer(text):
        low, comma, high = match.group(1), match.group(2), match.group(3)
        bound = int(high) if comma and high else int(low)
        if bound > 1 and bound not in seen:
            seen[bound] = match.group(0)
    return CompileCost([(where, what, _units(bound)) for bound, what in seen.items()])


def _is_string_schema(schema: dict) -> bool:
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _string_bounds(schema: dict, where: str, name: str, seen: dict[tuple, tuple[str, str]]) -> None:
    lengths = {k: schema[k] for k in ("minLength", "maxLength") if isinstance(schema.get(k), int)}
    if not lengths or not _is_string_schema(schema):
        return
    for other in ("pattern", "format"):
        if other in schema:  # xgrammar drops the lengths then (with a warning on stderr): refused, never ignored
            key = "maxLength" if "maxLength" in lengths else "minLength"
            raise InvalidRequestError(
                f"{name}: schema keyword {key!r} at {where or '/'} beside {other!r} is not supported: the grammar "
                f"would not enforce the length; allowed: a length inside the {other}'s own rule, or no {other}")
    bound = max(lengths.get("maxLength", 0), lengths.get("minLength", 0))
    if bound > 1:
        seen.setdefault((lengths.get("minLength"), lengths.get("maxLength")),
                        (where or "/", ", ".join(f"{k}={v}" for k, v in lengths.items())))


def _walk(schema: Any, where: str, name: str, seen: dict) -> None:
    if not isinstance(schema, dict):
        return
    _string_bounds(schema, where, name, seen)
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for sub_name, sub in value.items():
                _walk(sub, f"{where}/{key}/{sub_name}", name, seen)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, f"{where}/{key}/{i}", name, seen)
        elif key in SCHEMA_VALUES:
            _walk(value, f"{where}/{key}", name, seen)


def schema_cost(schema_text: str, name: str) -> CompileCost:
    """Bounded strings of a JSON schema (patterns inside a schema cost milliseconds: not counted)."""
    seen: dict[tuple, tuple[str, str]] = {}
    _walk(json.loads(schema_text), "", name, seen)
    return CompileCost([(where, what, _units(max(v for v in key if v is not None)))
                        for key, (where, what) in seen.items()])


def check_cost(cost: CompileCost, name: str) -> None:
    """Refuse, by name, a spec that would cost more than MAX_UNITS to compile (its largest parts named)."""
    if cost.units <= MAX_UNITS:
        return
    largest = sorted(cost.parts, key=lambda part: -part[2])[:3]
    named = "; ".join(f"{what} at {where}" if where else what for where, what, _ in largest)
    raise InvalidRequestError(
        f"{name} is too costly to compile: its bounded repetitions ({named}{'; ...' if len(cost.parts) > 3 else ''}) "
        f"count {cost.units} units: allowed at most {MAX_UNITS} (a bound counts up to {PLATEAU}, equal bounds once; "
        f"fewer distinct bounds, smaller ones, or a pattern cost less)")
