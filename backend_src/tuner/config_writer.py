"""Write a tuned `llm/configs/<name>.pbtxt`: llm/config.pbtxt with only parameter values changed.

The text of config.pbtxt is kept (comments included) and each tuned parameter's `string_value` is replaced
in place, so the file carries the whole model config (inputs, outputs, instance group) and follows its
source; `differences` parses both through Triton's protobuf and lists every change, so a test can check
that nothing but the tuned values differs.
"""
from __future__ import annotations

import re
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

# Tuner options that are not config.pbtxt parameters (yet): they travel in the header and the summary.
NOT_PARAMETERS = ("threads",)
# A tuned config's first line; configs tuned before the tuner became a package say "Tuned by perf/tune.py".
TUNED_MARKS = ("Tuned by python -m tuner", "Tuned by perf/tune.py")
HEADER_END = "# ---- end of the tuner's header; below: llm/config.pbtxt with tuned parameter values ----"


def _param_pattern(name: str) -> re.Pattern:
    # Both spellings protobuf accepts: `value: { string_value: "v" }` (hand-written) and `value {` (generated).
    return re.compile(r'(key:\s*"' + re.escape(name) + r'"\s*value\s*:?\s*\{\s*string_value:\s*")([^"]*)(")')


def engine_parameters(config_text: str) -> dict[str, str]:
    config = text_format.Parse(config_text, mc.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items()}


def render(source_text: str, options: dict, header: str) -> str:
    """source config text with options' values set; every option must already be a parameter there."""
    text = source_text
    for name, value in options.items():
        if name in NOT_PARAMETERS:
            continue
        pattern = _param_pattern(name)
        if len(pattern.findall(text)) != 1:
            raise KeyError(f"parameter {name!r} is not (exactly once) in the source config: allowed "
                           f"{', '.join(sorted(engine_parameters(source_text)))}")
        text = pattern.sub(lambda m, v=str(value): m.group(1) + v + m.group(3), text)
    lines = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return lines + HEADER_END + "\n" + text


def differences(source_text: str, tuned_text: str) -> dict[str, tuple[str, str]]:
    """Parameter name -> (source value, tuned value) for each change; raises if anything else differs."""
    a = text_format.Parse(source_text, mc.ModelConfig())
    b = text_format.Parse(tuned_text, mc.ModelConfig())
    changed = {k: (a.parameters[k].string_value, b.parameters[k].string_value) for k in a.parameters
               if k in b.parameters and a.parameters[k].string_value != b.parameters[k].string_value}
    if set(a.parameters) != set(b.parameters):
        raise ValueError(f"parameter names differ: {sorted(set(a.parameters) ^ set(b.parameters))}")
    for cfg in (a, b):
        cfg.ClearField("parameters")
    if a != b:
        raise ValueError("the tuned config differs from its source outside parameter values")
    return changed




def tuned_configs(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / "llm" / "configs").glob("*.pbtxt")
                  if any(mark in p.read_text() for mark in TUNED_MARKS))


def refresh(repo: Path, path: Path) -> bool:
    """Re-render a tuned config from the current llm/config.pbtxt, keeping its header and its parameter values
    (after llm's inputs, outputs or comments changed). True if the file changed."""
    source = (repo / "llm" / "config.pbtxt").read_text()
    old = path.read_text()
    lines = old.splitlines()
    end = lines.index(HEADER_END)
    header = "\n".join(line[2:] if line.startswith("# ") else "" for line in lines[:end])
    theirs = engine_parameters(source)
    values = {k: v for k, v in engine_parameters(old).items() if theirs.get(k) != v}
    text = render(source, values, header)
    if text == old:
        return False
    path.write_text(text)
    return True


def write(repo: Path, name: str, options: dict, header: str) -> Path:
    source = repo / "llm" / "config.pbtxt"
    dest = repo / "llm" / "configs" / f"{name}.pbtxt"
    if name in ("config", "dynamic"):
        raise ValueError(f"config name {name!r} is taken: allowed any other name")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"config name {name!r} is not allowed: letters, digits, _ . - only")
    text = render(source.read_text(), options, header)
    differences(source.read_text(), text)  # raises if the rendering changed anything else
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest
