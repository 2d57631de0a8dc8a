"""One way to configure the engine: every option is declared once (default, allowed values, doc), refused by
name when malformed, from config.pbtxt and from the environment alike, and only env_overrides.py reads an
INFLIGHT_* variable."""
import ast
import dataclasses
import logging
import re
from pathlib import Path

import pytest

from engine_helpers import MODEL_REPOSITORY, ROOT
from inflight.config import EngineConfig
from inflight.cpu_defaults import resolve_cpu_defaults
from inflight.env_overrides import OVERRIDES, read_overrides
from inflight.settings import AutoOrInts, Bools, Choices, Floats, Ints, Pattern, Text, allowed_of, doc_of
from serving.options import GlueParameters, parse_model_parameters

ALL_FIELDS = [*dataclasses.fields(EngineConfig), *dataclasses.fields(GlueParameters)]
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def _bad(allowed) -> str | None:
    """A string value outside `allowed`, or None where any text goes."""
    if isinstance(allowed, AutoOrInts):
        return str(allowed.hi + 1)
    if isinstance(allowed, Ints):
        return str(allowed.hi + 1)
    if isinstance(allowed, Floats):
        return "1.5" if allowed.hi == 1.0 else "-1"
    if isinstance(allowed, Bools):
        return "maybe"
    if isinstance(allowed, (Choices, Pattern)):
        return "no-such-choice"
    assert isinstance(allowed, Text), allowed
    return None


def _good(f) -> str:
    """A valid value other than the default, as an operator would write it."""
    allowed = allowed_of(f)
    if isinstance(allowed, Bools):
        return "0" if f.default else "1"
    if isinstance(allowed, Choices):
        return next(v for v in allowed.values if v != f.default)
    return "2"


@pytest.mark.parametrize("f", ALL_FIELDS, ids=lambda f: f.name)
def test_every_field_is_declared_with_a_doc_and_allowed_values_its_default_meets(f):
    assert doc_of(f).strip() and allowed_of(f).text
    assert allowed_of(f).check(f.name, f.default) == f.default


@pytest.mark.parametrize("f", [f for f in ALL_FIELDS if _bad(allowed_of(f)) is not None], ids=lambda f: f.name)
def test_a_bad_parameter_is_refused_naming_it_its_value_and_the_range(f):
    raw = _bad(allowed_of(f))
    with pytest.raises(ValueError) as info:
        parse_model_parameters({"model": "../models/tiny-llama", f.name: raw}, MODEL_REPOSITORY)
    message = str(info.value)
    assert re.search(rf"\b{f.name}='?{re.escape(raw)}'? is (out of range|malformed)", message), message
    assert any(part in message for part in (allowed_of(f).text, str(getattr(allowed_of(f), "hi", "")))), message


@pytest.mark.parametrize("var", OVERRIDES)
def test_each_override_sets_its_field_wins_over_the_options_and_is_logged(var, monkeypatch, caplog):
    f = ENGINE_FIELDS[OVERRIDES[var]]
    monkeypatch.setenv(var, _good(f))
    with caplog.at_level(logging.INFO, logger="inflight.env_overrides"):
        config = EngineConfig.from_options(**{f.name: f.default})
    assert getattr(config, f.name) != f.default
    assert f"environment override {var}: {f.name}=" in caplog.text


@pytest.mark.parametrize("var", OVERRIDES)
def test_a_bad_override_is_refused_naming_the_variable_its_value_and_the_range(var):
    f = ENGINE_FIELDS[OVERRIDES[var]]
    raw = _bad(allowed_of(f))
    with pytest.raises(ValueError) as info:
        read_overrides(EngineConfig, {var: raw})
    assert str(info.value) == (f"environment {var}={raw!r} is out of range: allowed {allowed_of(f).text} "
                               f"(it overrides the engine option {f.name})")


def test_a_blank_override_is_unset_and_options_build_without_the_environment():
    assert read_overrides(EngineConfig, {"INFLIGHT_CPU_GEMM": " "}) == {}
    assert EngineConfig.from_options(environ={}, cpu_gemm="blas").cpu_gemm == "blas"


def test_every_engine_switch_that_had_a_variable_has_one():
    assert set(OVERRIDES.values()) == {"cpu_gemm", "cpu_gemv_rows", "cpu_native_decode", "cpu_compile",
                                       "cpu_thread_governor", "fused_ops", "attention_backend"}


@pytest.mark.parametrize("vendor, rows, blas", [("GenuineIntel", 3, True), ("AuthenticAMD", 4, False), ("", 4, False)])
def test_auto_switches_resolve_per_cpu_and_say_why(vendor, rows, blas):
    chosen = resolve_cpu_defaults(EngineConfig(), vendor=vendor, onednn=True)
    assert (chosen.cpu_gemm, chosen.cpu_gemv_rows, chosen.few_row_blas) == ("onednn", rows, blas)
    assert (chosen.cpu_native_decode, chosen.cpu_compile, chosen.cpu_thread_governor) == (True, False, True)
    assert (chosen.fused_ops, chosen.attention_backend) == (False, "torch")
    assert resolve_cpu_defaults(EngineConfig(), vendor=vendor, onednn=False).cpu_gemm == "blas"
    line = chosen.summary("cpu")
    assert f"cpu_gemv_rows={rows} (auto: {vendor or 'unknown vendor'}" in line and "cpu_gemm=onednn (auto" in line
    cuda = resolve_cpu_defaults(EngineConfig(device="cuda"), vendor=vendor, onednn=True)
    assert (cuda.fused_ops, cuda.attention_backend) == (True, "triton")
    assert cuda.summary("cuda").startswith("fused_ops=true")


# Only this module reads INFLIGHT_* variables; tests may set them.
OVERRIDES_MODULE = Path(ROOT) / "backend_src" / "inflight" / "env_overrides.py"
SCANNED = ["backend_src", "model_repository", "scripts", "client"]
VARIABLE = re.compile(r"INFLIGHT_[A-Z0-9_]+")


def _variable_names(path: Path) -> list[tuple[int, str]]:
    """String constants in the file that are an INFLIGHT_* variable's name (prose that mentions one is not a
    read: docstrings and log messages hold more than the name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value)]


def test_no_module_but_env_overrides_names_an_inflight_variable():
    offenders = []
    for top in SCANNED:
        for path in sorted((Path(ROOT) / top).rglob("*.py")):
            if path != OVERRIDES_MODULE:
                offenders += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in _variable_names(path)]
    assert not offenders, ("read INFLIGHT_* variables through inflight/env_overrides.py (an EngineConfig field "
                           "and its override there), not here:\n" + "\n".join(offenders))
    assert {name for _, name in _variable_names(OVERRIDES_MODULE)} >= set(OVERRIDES)


def test_the_scan_sees_a_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nrows = os.environ.get("INFLIGHT_CPU_GEMV_ROWS", "")\n"""INFLIGHT_X in prose"""\n')
    assert _variable_names(sample) == [(2, "INFLIGHT_CPU_GEMV_ROWS")]
