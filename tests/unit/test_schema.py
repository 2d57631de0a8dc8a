"""The request schema (inflight.fields.FIELDS) is the one source: every consumer agrees with it."""
import dataclasses

import pytest

from engine_helpers import MODEL_REPOSITORY
from inflight.fields import BY_NAME, FIELDS, SAMPLING_FIELDS, SERVING_FIELDS, InvalidRequestError, parse_bool
from inflight.sequence import SamplingParams
from openai_frontend.protocol import _SAMPLING_FIELDS as OPENAI_FIELDS
from serving.contract import INPUT_NAMES, KEY_NAMES, ParsedRequest
from server_harness.repository import load_config


def test_sampling_params_are_the_sampling_rows_with_their_defaults():
    fields = dataclasses.fields(SamplingParams)
    assert [f.name for f in fields] == [f.name for f in SAMPLING_FIELDS]
    defaults = SamplingParams()
    for f in SAMPLING_FIELDS:
        assert getattr(defaults, f.name) == (list(f.default) if isinstance(f.default, tuple) else f.default)


def test_parsed_request_has_every_serving_flag_with_its_default():
    req = ParsedRequest(prompt="x")
    for f in SERVING_FIELDS:
        assert getattr(req, f.name) == f.default


def test_every_name_is_a_key_and_every_input_is_declared_in_the_llm_config():
    assert set(KEY_NAMES) == set(BY_NAME)
    declared = {t.name: t for t in load_config(MODEL_REPOSITORY / "llm" / "config.pbtxt").input}
    assert set(declared) == set(INPUT_NAMES)
    for name in INPUT_NAMES[2:]:
        f = BY_NAME[name]
        assert declared[name].optional and list(declared[name].dims) == f.dims
    assert "stop" not in declared  # vLLM's stop text vs TensorRT-LLM's cancel flag: a request parameter only


def test_openai_mapping_comes_from_the_table():
    assert {k: v.name for k, v in OPENAI_FIELDS.items()} == {f.openai: f.name for f in FIELDS if f.openai}


@pytest.mark.parametrize("field", [f for f in FIELDS if f.lo is not None or f.hi is not None], ids=lambda f: f.name)
def test_ranges_refuse_their_edges_as_the_allowed_text_says(field):
    """Just outside each bound is refused with a message naming the field and what is allowed."""
    outside = []
    if field.lo is not None:
        outside.append(field.lo if field.lo_open else field.lo - 1)
    if field.hi is not None:
        outside.append(field.hi if field.hi_open else field.hi + 1)
    for value in outside:
        with pytest.raises(InvalidRequestError) as info:
            field.parse(int(value) if field.kind == "int" else float(value))
        assert str(info.value).startswith(f"{field.name}=") and f"allowed {field.allowed}" in str(info.value)


def test_one_boolean_grammar():
    assert [parse_bool(t) for t in ("true", "False", " 1", "0", "yes", "NO", "on", "off")] == \
        [True, False, True, False, True, False, True, False]
    assert parse_bool("maybe") is None
