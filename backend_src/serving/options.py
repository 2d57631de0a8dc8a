"""config.pbtxt `parameters` -> EngineConfig + serving options; unknown or malformed names fail the load."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from inflight.config import EngineConfig
from inflight.fields import RequestLimits
from inflight.settings import Bools, Ints, Text, check_fields, parse_value, setting

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


_LIMITS = RequestLimits()
_CAP = Ints(1, 1 << 40)


@dataclass(frozen=True)
class GlueParameters:
    """The config.pbtxt parameters that are not EngineConfig fields: the Triton glue's settings and the request
    caps, declared as the engine's fields are (inflight/settings.py), so docs/parameters.md lists them too."""
    cancel_check_period_ms: int = setting(100, Ints(1, 60_000), (
        "How often in-flight requests are checked for cancellation (not per token)."))
    metrics_interval_ms: int = setting(1000, Ints(10, 3_600_000), "How often engine metrics are published on "
                                                                  "`/metrics`.")
    request_hook_module: str = setting("", Text("an importable module name, or empty for none"), (
        "Tests only: a module whose request hook claims one request parameter (serving/request_hooks.py; the "
        "fault tests name tests/fault_hooks.py, copied beside model.py)."))
    default_exclude_input_in_output: bool = setting(True, Bools(), (
        "For a request that does not say: true returns only new text; false puts the prompt before a "
        "non-streamed output, as vLLM and TensorRT-LLM do."))
    default_apply_chat_template: bool = setting(False, Bools(), (
        "For a request that does not say: false takes text_input as raw text (both peers); true renders the "
        "model's chat template around it, for raw-text clients of an instruct model."))
    # The abuse caps on list-valued fields and the sampling_parameters JSON (RequestLimits), checked before
    # any work; a prompt's own cap is the engine's max_prompt_bytes.
    max_json_bytes: int = setting(_LIMITS.max_json_bytes, _CAP, "Bytes of the sampling_parameters JSON at most.")
    max_stop_words: int = setting(_LIMITS.max_stop_words, _CAP, "Stop words, and bad words, per request at most.")
    max_word_bytes: int = setting(_LIMITS.max_word_bytes, _CAP, "Bytes of one stop or bad word at most.")
    max_stop_token_ids: int = setting(_LIMITS.max_stop_token_ids, _CAP, "Stop token ids per request at most.")
    max_grammar_bytes: int = setting(_LIMITS.max_grammar_bytes, _CAP, (
        "Bytes of one structured-output constraint at most: the structured_outputs object as JSON, or "
        "guided_decoding_guide (compiles also stop at the engine's grammar_compile_timeout_ms)."))

    def __post_init__(self) -> None:
        check_fields(self)


_GLUE_FIELDS = {f.name: f for f in dataclasses.fields(GlueParameters)}
_LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(RequestLimits))


def flatten_triton_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """{'name': {'string_value': 'v'}} (Triton's JSON form of config.pbtxt parameters) -> {'name': 'v'}."""
    out = {}
    for name, value in (model_config.get("parameters") or {}).items():
        if isinstance(value, Mapping):
            value = value.get("string_value", "")
        out[name] = str(value)
    return out


def resolve_model_path(raw: str, root: Path) -> Path:
    """Absolute paths stay; relative ones are taken against `root`, the model repository (the folder given to
    --model-repository), so a repository and its models can move together. The folder (or GGUF file) must
    exist: a typo should fail the load, not the first request."""
    path = Path(os.path.expandvars(os.path.expanduser(raw.strip())))
    if not path.is_absolute():
        path = root / path
    if not ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
        raise ValueError(f"parameter model={raw!r} resolves to {path}, which is neither a folder with a config.json "
                         f"nor a .gguf file: allowed a Hugging Face model folder or a GGUF file (absolute, or "
                         f"relative to the model repository {root})")
    return path


def parse_model_parameters(parameters: Mapping[str, str], root: Path) -> ServingOptions:
    """Split config.pbtxt parameters into engine options, request limits and glue settings.

    Blank values (a parameter left as "") mean "use the default"."""
    params = {k: v for k, v in parameters.items() if str(v).strip() != ""}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    known = engine_names | set(_GLUE_FIELDS)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown model parameter(s) {', '.join(unknown)}: allowed {', '.join(sorted(known))}")
    engine_opts = {k: v for k, v in params.items() if k in engine_names}
    engine_opts["model"] = str(resolve_model_path(engine_opts.get("model", DEFAULT_MODEL), root))
    try:
        engine = EngineConfig.from_options(**engine_opts)
    except ValueError as e:
        raise ValueError(f"model parameters: {e}") from None
    try:
        glue = GlueParameters(**{n: parse_value(f, params[n]) for n, f in _GLUE_FIELDS.items() if n in params})
    except ValueError as e:
        raise ValueError(f"parameter {e}") from None
    limits = RequestLimits(**{n: getattr(glue, n) for n in _LIMIT_NAMES})
    return ServingOptions(engine, limits, glue.cancel_check_period_ms / 1000.0, glue.metrics_interval_ms / 1000.0,
                          request_hook_module=glue.request_hook_module,
                          default_exclude_input_in_output=glue.default_exclude_input_in_output,
                          default_apply_chat_template=glue.default_apply_chat_template)
