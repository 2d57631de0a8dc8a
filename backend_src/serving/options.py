"""config.pbtxt `parameters` -> EngineConfig + serving options; unknown or malformed names fail the load."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from inflight.config import EngineConfig
from inflight.fields import RequestLimits, parse_bool

DEFAULT_MODEL = "../models/SmolLM2-135M-Instruct"  # the checkout's models/, seen from model_repository/


@dataclass(frozen=True)
class ServingOptions:
    engine: EngineConfig
    limits: RequestLimits
    cancel_check_period_s: float = 0.1
    metrics_interval_s: float = 1.0
    # Tests only: an importable module whose request hook claims a request parameter (serving.request_hooks).
    request_hook_module: str = ""
    # A request that does not say: true (ours) returns only new text; false (vLLM's and TensorRT-LLM's
    # default) puts the prompt before a non-streamed output.
    default_exclude_input_in_output: bool = True
    # A request that does not say: false (both peers) takes text_input as raw text; true renders the model's
    # chat template around it, for raw-text clients of an instruct model.
    default_apply_chat_template: bool = False

    @property
    def request_defaults(self) -> dict[str, bool]:
        return {"exclude_input_in_output": self.default_exclude_input_in_output,
                "apply_chat_template": self.default_apply_chat_template}


# name -> (default, lo, hi); glue settings that are not engine options.
_GLUE_INTS = {
    "cancel_check_period_ms": (100, 1, 60_000),
    "metrics_interval_ms": (1000, 10, 3_600_000),
}
_GLUE_STRS = {"request_hook_module": ""}
_GLUE_BOOLS = {"default_exclude_input_in_output": True,
               "default_apply_chat_template": False}
_LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(RequestLimits))


def flatten_triton_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """{'name': {'string_value': 'v'}} (Triton's JSON form of config.pbtxt parameters) -> {'name': 'v'}."""
    out = {}
    for name, value in (model_config.get("parameters") or {}).items():
        if isinstance(value, Mapping):
            value = value.get("string_value", "")
        out[name] = str(value)
    return out


def _int(name: str, raw: str, lo: int, hi: int) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"parameter {name}={raw!r} is malformed: expected an integer in [{lo}, {hi}]") from None
    if not lo <= value <= hi:
        raise ValueError(f"parameter {name}={value} is out of range: allowed [{lo}, {hi}]")
    return value


def _bool(name: str, raw: str) -> bool:
    flag = parse_bool(str(raw))
    if flag is None:
        raise ValueError(f"parameter {name}={raw!r} is malformed: expected true or false")
    return flag


def resolve_model_path(raw: str, root: Path) -> Path:
    """Absolute paths stay; relative ones are taken against `root`, the model repository (the folder given to
    --model-repository), so a repository and its models can move together. The folder must exist: a typo
    should fail the load, not the first request."""
    path = Path(os.path.expandvars(os.path.expanduser(raw.strip())))
    if not path.is_absolute():
        path = root / path
    if not (path / "config.json").is_file():
        raise ValueError(f"parameter model={raw!r} resolves to {path}, which holds no config.json: "
                         f"allowed a Hugging Face model folder (absolute, or relative to the model repository {root})")
    return path


def parse_model_parameters(parameters: Mapping[str, str], root: Path) -> ServingOptions:
    """Split config.pbtxt parameters into engine options, request limits and glue settings.

    Blank values (a parameter left as "") mean "use the default"."""
    params = {k: v for k, v in parameters.items() if str(v).strip() != ""}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    known = engine_names | set(_GLUE_INTS) | set(_GLUE_STRS) | set(_GLUE_BOOLS) | set(_LIMIT_NAMES)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown model parameter(s) {', '.join(unknown)}: allowed {', '.join(sorted(known))}")
    engine_opts = {k: v for k, v in params.items() if k in engine_names}
    engine_opts["model"] = str(resolve_model_path(engine_opts.get("model", DEFAULT_MODEL), root))
    try:
        engine = EngineConfig.from_options(**engine_opts)
    except ValueError as e:
        raise ValueError(f"model parameters: {e}") from None
    limits = RequestLimits(**{n: _int(n, params[n], 1, 1 << 40) for n in _LIMIT_NAMES if n in params})
    glue = {n: _int(n, params.get(n, str(d)), lo, hi) for n, (d, lo, hi) in _GLUE_INTS.items()}
    flags = {n: _bool(n, params[n]) if n in params else d for n, d in _GLUE_BOOLS.items()}
    flags |= {n: params.get(n, d).strip() for n, d in _GLUE_STRS.items()}
    return ServingOptions(engine, limits, glue["cancel_check_period_ms"] / 1000.0, glue["metrics_interval_ms"] / 1000.0,
                          **flags)
