"""Grammar compiles cannot starve each other: a costly schema in flight does not hold a trivial regex back, a compile
past its deadline is stopped (its process killed, its CPU given back) and cached as refused, and what would cost
too much is refused by name before compiling. SmolLM2's vocabulary (the tiny model's), where one bounded string
of a JSON schema costs xgrammar seconds."""
from __future__ import annotations

import os
import time

import pytest

from engine_helpers import TINY
from inflight.grammar.compiler import GrammarCache
from inflight.grammar.spec import from_structured_outputs
from inflight.tokenizer import load_tokenizer

# Two bounded strings with different bounds, at the cost cap: xgrammar compiles each on its own, ~3 s each on an
# AMD EPYC Zen 3 core.
COSTLY = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200},
                                           "b": {"type": "string", "maxLength": 199}}}


def new_cache(**kwargs) -> GrammarCache:
    return GrammarCache(lambda: load_tokenizer(TINY), 49152, [2], **kwargs)


@pytest.fixture
def cache():
    made = new_cache(timeout_ms=60_000)
    made.request(from_structured_outputs({"regex": "warm"})).result()  # the vocabulary read once, not timed below
    yield made
    made.close()


def test_a_trivial_regex_is_ready_within_a_second_while_a_costly_schema_compiles(cache):
    costly = cache.request(from_structured_outputs({"json": COSTLY}))
    time.sleep(0.2)  # the costly compile has started
    t0 = time.monotonic()
    trivial = cache.request(from_structured_outputs({"regex": "yes|no"}))
    trivial.future.result(timeout=30)
    waited = time.monotonic() - t0
    assert waited <= 1.0, f"the trivial regex waited {waited:.2f} s behind the costly schema"
    assert not costly.is_ready, "the costly schema compiled too fast to show anything"
    assert trivial.result().error is None
    assert costly.future.result(timeout=60).error is None


def test_a_compile_past_its_deadline_is_killed_and_its_spec_stays_refused():
    cache = new_cache(timeout_ms=1500)
    try:
        cache.warm_up()
        spec = from_structured_outputs({"json": COSTLY})
        first = cache.request(spec)
        time.sleep(0.5)
        pid = cache.pool.pids()["heavy"]
        compiled = first.future.result(timeout=30)
        assert compiled.timed_out and "grammar_compile_timeout_ms=1500" in compiled.error, compiled.error
        assert time.monotonic() - first.requested_at < 3.0  # stopped at its deadline, not when it would have ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the process that compiled it is gone: its core is free again
        misses = cache.num_misses
        again = cache.request(spec)
        assert again.cache_hit and again.is_ready and again.result().timed_out  # refused at once, not compiled again
        assert cache.num_misses == misses
    finally:
        cache.close()


def test_a_cheap_looking_spec_that_is_not_moves_to_the_heavy_lane_and_still_compiles(cache):
    cache.pool.light_limit_s = 0.05  # what the light lane allows a compile before it is deemed mis-told
    spec = from_structured_outputs({"json": {"type": "string", "maxLength": 16}})  # 16 units: told cheap
    assert spec.cost.is_light
    handle = cache.request(spec)
    assert handle.future.result(timeout=30).error is None
    t0 = time.monotonic()
    assert cache.request(from_structured_outputs({"regex": "on|off"})).future.result(timeout=30).error is None
    assert time.monotonic() - t0 <= 1.0  # the light lane's process was replaced at once


def test_a_spec_that_only_waited_past_its_deadline_is_not_cached_as_refused():
    cache = new_cache(timeout_ms=1)
    try:
        spec = from_structured_outputs({"regex": "[ab]"})
        first = cache.request(spec)  # the vocabulary is read first (~1 s): the job's deadline has passed by then
        compiled = first.future.result(timeout=30)
        assert compiled.timed_out and "waited past grammar_compile_timeout_ms=1" in compiled.error, compiled.error
        again = cache.request(spec)
        assert not again.cache_hit
    finally:
        cache.close()


def test_close_ends_every_compile_and_its_processes():
    cache = new_cache(timeout_ms=60_000)
    handle = cache.request(from_structured_outputs({"json": COSTLY}))
    queued = cache.request(from_structured_outputs({"json": {"type": "string", "maxLength": 77}}))
    deadline = time.monotonic() + 30
    while len(cache.pool.pids()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = list(cache.pool.pids().values())
    cache.close()
    for h in (handle, queued):
        assert h.future.result(timeout=10).error is not None
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("schema, words", [
    # The review's 214-byte schema: four strings of different, large bounds (18.7 s to compile there).
    ({"type": "object", "properties": {k: {"type": "string", "maxLength": 20000 - i} for i, k in enumerate("abcd")}},
     ["too costly to compile", "maxLength=20000 at /properties/a", "allowed at most 256"]),
    ({"type": "string", "format": "email", "maxLength": 40}, ["'maxLength' at / beside 'format'", "not supported"]),
    ({"type": "string", "pattern": "^[a-z]+[0-9]$", "minLength": 3}, ["'minLength' at / beside 'pattern'"]),
])
def test_what_would_cost_too_much_or_go_unenforced_is_refused_by_name(schema, words):
    from inflight.fields import InvalidRequestError
    with pytest.raises(InvalidRequestError) as refused:
        from_structured_outputs({"json": schema})
    assert all(w in str(refused.value) for w in words), str(refused.value)


def test_equal_bounds_count_once_and_cheap_specs_are_told_cheap():
    same = {"type": "object", "properties": {k: {"type": "string", "maxLength": 300} for k in "abcd"}}
    assert from_structured_outputs({"json": same}).cost.units == 128
    assert from_structured_outputs({"regex": "yes|no"}).cost.is_light
    assert from_structured_outputs({"choice": ["a", "b"]}).cost.is_light
    assert not from_structured_outputs({"regex": "[a-z]{0,100}"}).cost.is_light


def test_a_process_that_grew_past_its_memory_cap_is_replaced_after_its_compile(cache, monkeypatch):
    from inflight.grammar import compile_pool
    monkeypatch.setattr(compile_pool, "RECYCLE_RSS_MB", 0)  # every process is past it: replaced after each job
    deadline = time.monotonic() + 30
    while len(cache.pool.pids()) < 2 and time.monotonic() < deadline:  # both lanes' processes up
        time.sleep(0.05)
    before = set(cache.pool.pids().values())  # either idle lane may take a cheap job: the one that ran it is replaced
    assert len(before) == 2
    assert cache.request(from_structured_outputs({"regex": "grow|shrink"})).future.result(timeout=30).error is None
    deadline = time.monotonic() + 30
    while not set(cache.pool.pids().values()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(cache.pool.pids().values()) - before
    assert cache.request(from_structured_outputs({"regex": "again"})).future.result(timeout=30).error is None
