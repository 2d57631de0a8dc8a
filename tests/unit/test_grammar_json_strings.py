"""Two ways xgrammar 0.2.8 lets invalid JSON through a JSON schema, closed in the engine's compile path (a real
GrammarCache and its worker processes over SmolLM2's vocabulary, the tiny model's): a string with minLength or
maxLength took raw control characters (a tab), and an optional group holding a loop in a `pattern` let its loop be
entered without the group's start."""
from __future__ import annotations

import pytest

from engine_helpers import TINY
from inflight.grammar.compiler import GrammarCache
from inflight.grammar.spec import from_structured_outputs
from inflight.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def cache(tokenizer):
    made = GrammarCache(lambda: load_tokenizer(TINY), 49152, [tokenizer.eos_token_id], timeout_ms=60_000)
    yield made
    made.close()


def matcher_after(cache, tokenizer, schema: dict, text: str):
    """A matcher for the schema's grammar that has accepted `text` (token by token)."""
    handle = cache.request(from_structured_outputs({"json": schema, "disable_any_whitespace": True}))
    assert handle.future.result(timeout=60).error is None
    matcher = cache.new_matcher(handle)
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token), f"{tokenizer.decode([token])!r} refused after {text!r}"
    return matcher


def one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


@pytest.mark.parametrize("bounds", [{"maxLength": 8}, {"minLength": 2}])
def test_a_length_bounded_string_takes_no_raw_control_character(cache, tokenizer, bounds):
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}
    matcher = matcher_after(cache, tokenizer, schema, '{"s": "a')
    assert not matcher.accept_token(one_token(tokenizer, "\t")), "a raw tab inside a JSON string"
    assert matcher.accept_token(one_token(tokenizer, "b"))


def test_an_optional_group_with_a_loop_keeps_its_start(cache, tokenizer):
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": "^(Z[0-9]*)?K$"}},
              "required": ["k"]}
    matcher = matcher_after(cache, tokenizer, schema, '{"k": "')
    assert not matcher.accept_token(one_token(tokenizer, "0")), "a digit before the group's Z"
    assert matcher.accept_token(one_token(tokenizer, "Z"))
