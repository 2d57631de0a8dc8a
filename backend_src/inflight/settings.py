"""Declared settings: each field's default, allowed values and doc in one `setting(...)`, read by validation,
the config.pbtxt and environment parsers, and the docs generator (scripts/gen_configs.py -> docs/parameters.md)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from .fields import parse_bool


class Allowed:
    """What values a setting takes: `text` for docs and errors, `parse` for config.pbtxt and environment strings,
    `check` for a value of the field's type (an error names the setting, the value and what is allowed)."""
    text = ""

    def parse(self, name: str, raw: str) -> Any:
        return raw.strip()

    def check(self, name: str, value: Any) -> Any:
        return value

    def refuse(self, name: str, value: Any) -> ValueError:
        return ValueError(f"{name}={value!r} is out of range: allowed {self.text}")


@dataclass(frozen=True)
class Ints(Allowed):
    lo: int
    hi: int

    @property
    def text(self) -> str:
        return f"integers in [{self.lo}, {self.hi}]"

    def parse(self, name: str, raw: str) -> Any:
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r} is malformed: expected an integer in [{self.lo}, {self.hi}]") from None

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool) or not self.lo <= value <= self.hi:
            raise self.refuse(name, value)
        return value


@dataclass(frozen=True)
class AutoOrInts(Ints):
    """"auto" (chosen per CPU when the engine loads, see cpu_defaults.py) or an integer in [lo, hi]."""

    @property
    def text(self) -> str:
        return f"auto or integers in [{self.lo}, {self.hi}]"

    def parse(self, name: str, raw: str) -> Any:
        text = raw.strip().lower()
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise self.refuse(name, raw) from None

    def check(self, name: str, value: Any) -> Any:
        return value if value == "auto" else super().check(name, value)


@dataclass(frozen=True)
class Floats(Allowed):
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    @property
    def text(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def parse(self, name: str, raw: str) -> Any:
        try:
            return float(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r} is malformed: expected a number in {self.text}") from None

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.refuse(name, value)
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        if not (above and below):
            raise self.refuse(name, value)
        return float(value)


@dataclass(frozen=True)
class Bools(Allowed):
    text = "true or false (also 1/0, yes/no, on/off)"

    def parse(self, name: str, raw: str) -> Any:
        flag = parse_bool(raw)
        if flag is None:
            raise ValueError(f"{name}={raw!r} is malformed: expected true or false (or 1/0, yes/no, on/off)")
        return flag

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is malformed: expected true or false")
        return value


@dataclass(frozen=True)
class Choices(Allowed):
    values: tuple[str, ...]

    @property
    def text(self) -> str:
        return ", ".join(self.values)

    def parse(self, name: str, raw: str) -> Any:
        return raw.strip().lower()

    def check(self, name: str, value: Any) -> Any:
        if value not in self.values:
            raise self.refuse(name, value)
        return value


@dataclass(frozen=True)
class Pattern(Allowed):
    regex: str
    text: str = ""

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str) or not re.fullmatch(self.regex, value):
            raise self.refuse(name, value)
        return value


@dataclass(frozen=True)
class Text(Allowed):
    text: str = "any text"

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str):
            raise self.refuse(name, value)
        return value


def setting(default: Any, allowed: Allowed, doc: str) -> Any:
    """A dataclass field that carries its allowed values and its doc (one or two sentences, for readers)."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "doc": doc})


def allowed_of(f: dataclasses.Field) -> Allowed:
    return f.metadata["allowed"]


def doc_of(f: dataclasses.Field) -> str:
    return f.metadata["doc"]


def check_fields(record: Any) -> None:
    """Validate every declared field of a dataclass instance, normalizing where the allowed values say (an int
    passed for a float)."""
    for f in dataclasses.fields(record):
        if "allowed" in f.metadata:
            value = allowed_of(f).check(f.name, getattr(record, f.name))
            if value is not getattr(record, f.name):
                object.__setattr__(record, f.name, value)  # frozen records too: this runs in __post_init__


def parse_value(f: dataclasses.Field, raw: Any, name: str | None = None) -> Any:
    """A value for field `f` from a string (config.pbtxt, the environment) or a Python value, checked. `name`
    is what an error calls it (the field's name, or the environment variable that set it)."""
    allowed, label = allowed_of(f), name or f.name
    value = allowed.parse(label, raw) if isinstance(raw, str) and not isinstance(allowed, (Text, Pattern)) else raw
    if isinstance(value, str) and isinstance(allowed, (Text, Pattern)):
        value = value.strip()
    return allowed.check(label, value)
