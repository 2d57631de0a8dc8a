"""Fault injection for tests, a request hook (serving.request_hooks): with the model parameter
`request_hook_module: fault_hooks`, a request parameter `inject_fault` arms the engine's step_hook. Without it the
parameter is refused as unknown. Served models import this file from their version folder (see ON and FILE).

Specs (one string):
  error              the next engine step raises (every in-flight request then gets an error final)
  error:after=N      the N-th engine step from now raises (N >= 1)
  slow:ms=M,steps=N  the next N engine steps each sleep M ms first (makes prefill/decode windows wide)
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inflight.fields import InvalidRequestError

PARAMETER = "inject_fault"
FILE = Path(__file__)  # copied beside a test repository's model.py: the Python backend puts that folder on sys.path
ON = {"request_hook_module": FILE.stem}  # the model parameter that loads it
_LIMITS = {"after": (1, 100_000), "ms": (1, 10_000), "steps": (1, 100_000)}
_KINDS = {"error": {"after": 1}, "slow": {"ms": None, "steps": None}}
_ALLOWED = "'error', 'error:after=N', or 'slow:ms=M,steps=N'"


class InjectedFault(RuntimeError):
    """Raised inside an engine step on purpose."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    values: dict


def parse_fault(raw) -> FaultSpec:
    """Parse an `inject_fault` value; InvalidRequestError names the value and what is allowed."""
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidRequestError(f"{PARAMETER}={raw!r} is invalid: allowed {_ALLOWED}")
    kind, _, rest = raw.strip().partition(":")
    if kind not in _KINDS:
        raise InvalidRequestError(f"{PARAMETER}={raw!r} is invalid: allowed {_ALLOWED}")
    values = dict(_KINDS[kind])
    for item in filter(None, rest.split(",")):
        key, _, text = item.partition("=")
        key = key.strip()
        if key not in values:
            raise InvalidRequestError(f"{PARAMETER}={raw!r} has an unknown key {key!r}: allowed {_ALLOWED}")
        lo, hi = _LIMITS[key]
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise InvalidRequestError(f"{PARAMETER}={raw!r}: {key}={text!r} is out of range: allowed [{lo}, {hi}]")
        values[key] = value
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise InvalidRequestError(f"{PARAMETER}={raw!r} lacks {missing[0]}=: allowed {_ALLOWED}")
    return FaultSpec(kind, values)


class FaultInjector:
    """A RequestHook claiming `inject_fault`, and the engine's step_hook: armed from request threads, fired in
    the engine thread."""

    parameter = PARAMETER

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error_in: int | None = None  # steps until the armed error fires
        self._sleep_s = 0.0
        self._sleep_steps = 0
        self.num_faults = 0

    def attach(self, engine) -> None:
        engine.step_hook = self

    def parse(self, raw) -> FaultSpec:
        return parse_fault(raw)

    def apply(self, spec: FaultSpec) -> None:
        self.arm(spec)

    def arm(self, spec: FaultSpec) -> None:
        with self._lock:
            if spec.kind == "error":
                self._error_in = spec.values["after"]
            else:
                self._sleep_s = spec.values["ms"] / 1000.0
                self._sleep_steps = spec.values["steps"]

    def __call__(self) -> None:
        with self._lock:
            sleep_s = self._sleep_s if self._sleep_steps > 0 else 0.0
            self._sleep_steps = max(0, self._sleep_steps - 1)
            fire = False
            if self._error_in is not None:
                self._error_in -= 1
                if self._error_in <= 0:
                    self._error_in, fire = None, True
                    self.num_faults += 1
        if sleep_s:
            time.sleep(sleep_s)
        if fire:
            raise InjectedFault("fault injected by a test hook (inject_fault)")


def make_request_hook() -> FaultInjector:
    """The factory serving.request_hooks.load_request_hook calls."""
    return FaultInjector()
