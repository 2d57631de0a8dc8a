"""Structured output in the engine, without Triton: specs from every way in, the compiled-grammar cache and its
worker, the queue wait, refusals, the per-step mask beside unconstrained rows, n, preemption, min_tokens,
logprobs, stop strings and the static arm. The tiny random Llama (SmolLM2's vocabulary) writes noise, so
whatever is valid below is the grammar's doing."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight import EngineConfig, FinishReason, InvalidRequestError, SamplingParams
from inflight.engine import LLMEngine
from inflight.fields import RequestLimits
from inflight.grammar.spec import CHOICE, EBNF, JSON_ANY, JSON_OBJECT, JSON_SCHEMA, LARK, REGEX
from serving.contract import parse_request

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"type": "string", "enum": ["a", "b"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["id", "kind", "tags", "inner"]}
TIGHT = {"disable_any_whitespace": True}  # noise would otherwise fill its budget with legal whitespace


def structured(max_tokens: int = 120, temperature: float = 0.0, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, structured_outputs=spec)


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Run requests to the end: {(request id, sample): (text, finish reason, error, refused)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    texts: dict = {}
    out: dict = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        if engine.waits_only_for_grammars():
            time.sleep(0.005)  # a worker compiles; the engine loop would sleep on its inbox here
        for o in engine.step():
            key = (o.request_id, o.index)
            texts[key] = texts.get(key, "") + o.text_delta
            if o.finished:
                out[key] = (texts[key], o.finish_reason, o.error, o.refused)
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
    return out


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=96, max_model_len=256, max_num_seqs=16))


# ---- specs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, kind", [
    ({"structured_outputs": {"json": SCHEMA}}, JSON_SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, JSON_SCHEMA),
    ({"structured_outputs": {"json_object": True}}, JSON_OBJECT),
    ({"structured_outputs": {"regex": "a+"}}, REGEX),
    ({"structured_outputs": {"choice": ["x", "y"]}}, CHOICE),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, EBNF),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, LARK),
    ({"guided_decoding_guide_type": "json"}, JSON_ANY),
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMA)}, JSON_SCHEMA),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a+"}, REGEX),
    ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'root ::= "x"'}, EBNF),
])
def test_every_way_in_becomes_one_spec(given, kind):
    assert SamplingParams(**given).grammar.kind == kind
    assert SamplingParams().grammar is None


def test_the_vllm_older_name_and_the_schema_order_are_kept():
    req = parse_request({"text_input": np.array([b"x"], dtype=object), "sampling_parameters": np.array(
        [json.dumps({"guided_decoding": {"json": {"properties": {"b": {}, "a": {}}, "type": "object"}}}).encode()],
        dtype=object)})
    assert list(json.loads(req.params.grammar.text)["properties"]) == ["b", "a"]  # order shapes output


@pytest.mark.parametrize("given, words", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, ["exactly one", "sets 2"]),
    ({"structured_outputs": {}}, ["exactly one", "sets none"]),
    ({"structured_outputs": {"jsn": {}}}, ["key 'jsn' is unknown", "allowed keys"]),
    ({"structured_outputs": {"choice": "x"}}, ["structured_outputs.choice='x'", "non-empty list"]),
    ({"structured_outputs": {"json": "{not json"}}, ["structured_outputs.json", "a JSON schema"]),
    ({"structured_outputs": {"json": {"properties": {"a": {"type": "string", "not": {"pattern": "x"}}}}}},
     ["'not' at /properties/a", "not supported"]),
    ({"structured_outputs": {"json": {"allOf": [{"type": "string", "pattern": "a"}, {"pattern": "b"}]}}},
     ["'pattern' at /allOf/1", "two patterns"]),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, ["backend='outlines'", "xgrammar"]),
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "x"}, ["guided_decoding_guide_type='xml'"]),
    ({"guided_decoding_guide_type": "regex"}, ["guided_decoding_guide", "missing"]),
    ({"guided_decoding_guide": "a+"}, ["guided_decoding_guide", "given alone"]),
    ({"guided_decoding_guide_type": "json", "structured_outputs": {"regex": "a"}}, ["give one"]),
])
def test_bad_specs_are_refused_by_name(given, words):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**given)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_grammar_size_cap_applies_on_every_way_in():
    limits = RequestLimits(max_grammar_bytes=100)
    big = {"type": "string", "enum": ["x" * 50, "y" * 50]}
    for params in ({"sampling_parameters": np.array([json.dumps({"structured_outputs": {"json": big}}).encode()],
                                                    dtype=object)},
                   {"guided_decoding_guide_type": np.array([b"json_schema"], dtype=object),
                    "guided_decoding_guide": np.array([json.dumps(big).encode()], dtype=object)}):
        with pytest.raises(InvalidRequestError, match="at most 100 bytes"):
            parse_request({"text_input": np.array([b"x"], dtype=object), **params}, limits=limits)


# ---- the engine ---------------------------------------------------------------------------------------

def test_schema_regex_choice_and_grammar_hold_whatever_the_model(engine):
    out = run(engine, {
        "json": ("Hello", structured(json=SCHEMA, **TIGHT)),
        "json_sampled": ("Hello", structured(temperature=1.0, json=SCHEMA, **TIGHT)),
        "obj": ("Hello", structured(max_tokens=200, json_object=True, **TIGHT)),
        "date": ("Hello", structured(regex=r"\d{4}-\d{2}-\d{2}")),
        "choice": ("Hello", structured(choice=["red", "green", "blue"])),
        "ebnf": ("Hello", structured(grammar='root ::= "n=" [0-9]+ ";"', max_tokens=30)),
    })
    for key in ("json", "json_sampled"):
        text, reason, _, _ = out[(key, 0)]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason in (FinishReason.EOS, FinishReason.STOP), reason
    text, reason, _, _ = out[("obj", 0)]
    assert reason == FinishReason.LENGTH or isinstance(json.loads(text), dict)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", out[("date", 0)][0])
    assert out[("choice", 0)][0] in ("red", "green", "blue")
    ebnf, reason, _, _ = out[("ebnf", 0)]
    assert re.fullmatch(r"n=[0-9]+;", ebnf) or (reason == FinishReason.LENGTH and re.fullmatch(r"n=[0-9]*", ebnf))


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(engine):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run(engine, {"u": ("Once upon a time", plain)})
    mixed = run(engine, {"c1": ("Once upon a time", structured(json=SCHEMA, **TIGHT)),
                         "u": ("Once upon a time", plain), "c2": ("Hello", structured(choice=["yes", "no"]))})
    assert mixed[("u", 0)][0] == alone[("u", 0)][0]


def test_a_cached_grammar_is_not_compiled_again(engine):
    before = engine.metrics.snapshot()["counters"]
    spec = {"regex": "(ab|cd){1,3}"}
    run(engine, {"first": ("x", structured(**spec))})
    run(engine, {"second": ("y", structured(**spec)), "third": ("z", structured(**spec))})
    after = engine.metrics.snapshot()["counters"]
    assert after["grammar_cache_misses"] - before["grammar_cache_misses"] == 1
    assert after["grammar_cache_hits"] - before["grammar_cache_hits"] == 2


def test_a_request_waits_for_its_grammar_without_taking_a_block_then_runs(engine, monkeypatch):
    gate = threading.Event()
    real = engine.grammars.pool._run
    monkeypatch.setattr(engine.grammars.pool, "_run", lambda lane, job: gate.wait(30) and real(lane, job))
    engine.add_request("slow", "Hello", structured(regex="slow[0-9]"))
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    seq = engine.seqs["slow"]
    for _ in range(6):  # the plain request runs to its end meanwhile; the constrained one holds no block
        engine.step()
        assert seq.waits_for_grammar and not seq.block_table and seq in engine.scheduler.waiting
    assert "plain" not in engine.seqs and engine.waits_only_for_grammars()
    gate.set()
    texts = ""
    while engine.has_unfinished_requests():
        texts += "".join(o.text_delta for o in engine.step())
    assert re.fullmatch("slow[0-9]", texts)
    assert_pool_whole(engine)


def test_compile_errors_and_timeouts_are_refused_before_any_block():
    engine = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=32, max_model_len=128, grammar_compile_timeout_ms=50))
    engine.grammars.warm_up()  # the tokenizer's vocabulary, read once (about a second), is not the compile's time
    gate = threading.Event()
    real = engine.grammars.pool._run
    engine.grammars.pool._run = lambda lane, job: real(lane, job) if "fast" in job.spec.text or gate.wait(30) else None
    out = run(engine, {"bad": ("x", structured(regex="[fast")), "late": ("x", structured(regex="late+"))})
    gate.set()
    text, reason, error, refused = out[("bad", 0)]
    assert reason == FinishReason.ERROR and refused and "structured_outputs.regex='[fast'" in error, error
    text, reason, error, refused = out[("late", 0)]
    assert reason == FinishReason.ERROR and refused and "grammar_compile_timeout_ms=50" in error, error
    counters = engine.metrics.snapshot()["counters"]
    assert counters["grammar_compile_timeouts"] == 1
    engine.grammars.close()


def test_n_samples_each_have_their_own_matcher(engine):
    out = run(engine, {"n": ("Hello", SamplingParams(n=3, max_tokens=40, temperature=1.0, seed=5,
                                                      structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"}))})
    texts = [out[("n", i)][0] for i in range(3)]
    assert all(re.fullmatch("[a-z]{3}-[0-9]{2}", t) for t in texts), texts
    assert len(set(texts)) > 1


def test_preempted_constrained_requests_keep_their_matcher():
    engine = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=12, max_model_len=160, max_num_seqs=4))
    # Each output is 60 pairs long (60-120 tokens): four of them cannot keep their blocks in a pool of 12.
    reqs = {f"p{i}": (f"Request number {i} says", SamplingParams(max_tokens=124, temperature=1.0, seed=i,
                                                                  structured_outputs={"regex": "(ab|cd){60}!"}))
            for i in range(4)}
    out = run(engine, reqs)
    assert engine.metrics.snapshot()["counters"]["num_preemptions_total"] > 0
    for i in range(4):
        text, reason, _, _ = out[(f"p{i}", 0)]
        assert re.fullmatch("(ab|cd){60}!", text) or (reason == FinishReason.LENGTH
                                                      and re.fullmatch("(ab|cd)*[ac]?", text)), text


def test_min_tokens_yields_to_a_grammar_that_can_only_end(engine):
    out = run(engine, {"m": ("Hello", SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0,
                                                      structured_outputs={"choice": ["ok"]}))})
    assert out[("m", 0)][:2] == ("ok", FinishReason.EOS)


def test_logprobs_are_of_the_masked_distribution(engine):
    engine.add_request("lp", "Hello", SamplingParams(max_tokens=4, temperature=0.0, logprobs=5,
                                                      structured_outputs={"choice": ["yes", "no"]}))
    first = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.logprobs and first is None:
                first = o.logprobs[0]
    finite = [engine.tokenizer.decode([tid]) for tid, (lp, _, _) in first.top.items() if lp > float("-inf")]
    assert finite and all(text and ("yes".startswith(text) or "no".startswith(text)) for text in finite), finite
    assert_pool_whole(engine)


def test_a_stop_string_still_cuts_a_constrained_output(engine):
    out = run(engine, {"s": ("Hello", SamplingParams(max_tokens=20, temperature=0.0, stop=["-"],
                                                      structured_outputs={"regex": "[0-9]{2}-[0-9]{2}"}))})
    text, reason, _, _ = out[("s", 0)]
    assert reason == FinishReason.STOP and re.fullmatch("[0-9]{2}", text)


def test_the_static_arm_admits_its_batch_once_every_grammar_compiled():
    engine = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_model_len=128, static_batching=True))
    out = run(engine, {"a": ("x", structured(regex="[xy]{4}")), "b": ("y", structured(choice=["one", "two"])),
                       "c": ("z", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))})
    assert re.fullmatch("[xy]{4}", out[("a", 0)][0]) and out[("b", 0)][0] in ("one", "two")
    engine.grammars.close()


def test_the_loop_sleeps_while_only_a_grammar_compiles_and_wakes_when_it_is_done(engine, monkeypatch):
    """No spinning: while nothing but a compiling request is left, the loop waits on its inbox (woken by the
    compile's end) instead of calling step() back to back."""
    from inflight.engine import EngineLoop

    gate = threading.Event()
    real = engine.grammars.pool._run
    monkeypatch.setattr(engine.grammars.pool, "_run", lambda lane, job: gate.wait(30) and real(lane, job))
    texts = []
    done = threading.Event()

    def collect(outs):
        texts.extend(o.text_delta for o in outs)
        if any(o.finished for o in outs):
            done.set()

    steps = [0]
    real_step = engine.step

    def counted_step():
        steps[0] += 1
        return real_step()

    monkeypatch.setattr(engine, "step", counted_step)
    loop = EngineLoop(engine, collect, idle_wait_s=0.05)
    loop.start()
    try:
        loop.add_request("gated", "Hello", structured(regex="gated[0-9]"))
        time.sleep(0.5)  # ten idle waits at most; a spinning loop would step thousands of times
        assert steps[0] <= 15, f"{steps[0]} steps while waiting for a grammar"
        gate.set()
        assert done.wait(60), "the request never finished"
    finally:
        loop.stop()
    assert re.fullmatch("gated[0-9]", "".join(texts)), texts
    assert_pool_whole(engine)
