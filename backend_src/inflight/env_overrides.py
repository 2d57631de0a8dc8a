"""The operator's environment overrides: the one module that reads INFLIGHT_* variables.

Each variable sets one EngineConfig field, parsed and checked as that field is (an error names the variable,
its value and what is allowed), and wins over config.pbtxt and `LLM(**options)`: whoever starts the server
can change a switch without editing the model repository. Each override applied is logged. Two more are
settings of the host rather than of an engine, read only here as well: where native builds are cached, and
the health probe's address.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, TypeVar

from .settings import allowed_of, parse_value

log = logging.getLogger(__name__)

# An EngineConfig: config.py imports this module to apply the overrides as it builds one, never the other way.
Config = TypeVar("Config")

ATTENTION_ENV = "INFLIGHT_ATTENTION"
# variable -> EngineConfig field
OVERRIDES: dict[str, str] = {
    "INFLIGHT_CPU_GEMM": "cpu_gemm",
    "INFLIGHT_CPU_GEMV_ROWS": "cpu_gemv_rows",
    "INFLIGHT_CPU_NATIVE": "cpu_native_decode",
    "INFLIGHT_CPU_COMPILE": "cpu_compile",
    "INFLIGHT_CPU_GOVERNOR": "cpu_thread_governor",
    "INFLIGHT_FUSED_OPS": "fused_ops",
    ATTENTION_ENV: "attention_backend",
}
NATIVE_CACHE_ENV = "INFLIGHT_NATIVE_CACHE"
HEALTH_URL_ENV = "INFLIGHT_HEALTH_URL"
# variable -> what it sets, for docs/parameters.md: no engine field, the environment only.
ENV_ONLY: dict[str, str] = {
    NATIVE_CACHE_ENV: ("Directory of the compiled native decode step (default `$XDG_CACHE_HOME/inflight-native`, "
                       "else `~/.cache/inflight-native`); the image sets `/opt/llm/native`, built ahead with "
                       "`python -m inflight.model.native_decode`."),
    HEALTH_URL_ENV: ("Base URL the `llm` model asks whether it is still served (`off` disables the probe); "
                     "default: from the parent tritonserver's `--http-address`/`--http-port`, on 127.0.0.1."),
}


def env_name(field: str) -> str | None:
    """The variable that overrides this EngineConfig field, if any."""
    return next((var for var, name in OVERRIDES.items() if name == field), None)


def read_overrides(config, environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """{field: value} for every override variable set (a blank one counts as unset), checked as the field of
    `config` (an EngineConfig, or the class) is."""
    env = os.environ if environ is None else environ
    fields = {f.name: f for f in dataclasses.fields(config)}
    values = {}
    for var, name in OVERRIDES.items():
        raw = env.get(var, "")
        if not raw.strip():
            continue
        try:
            values[name] = parse_value(fields[name], raw, var)
        except ValueError:
            raise ValueError(f"environment {var}={raw!r} is out of range: allowed "
                             f"{allowed_of(fields[name]).text} (it overrides the engine option {name})") from None
    return values


def apply_env_overrides(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """The config with the environment's overrides applied (the config itself when there are none)."""
    values = read_overrides(config, environ)
    for name, value in values.items():
        log.info("environment override %s: %s=%r (the config said %r)", env_name(name), name, value,
                 getattr(config, name))
    return dataclasses.replace(config, **values) if values else config


def native_cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """INFLIGHT_NATIVE_CACHE, where set: the directory of the compiled native decode step."""
    env = os.environ if environ is None else environ
    return env.get(NATIVE_CACHE_ENV) or None


def health_url(environ: Mapping[str, str] | None = None) -> str:
    """INFLIGHT_HEALTH_URL, stripped ("" where unset): the health probe's base URL, or "off"."""
    env = os.environ if environ is None else environ
    return env.get(HEALTH_URL_ENV, "").strip()
