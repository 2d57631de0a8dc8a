"""Structured output and tool calling through the real tritonserver with SmolLM2-135M-Instruct, on every way in:
vLLM's `structured_outputs` / `guided_decoding` (model `llm`), TensorRT-LLM's guide inputs (`ensemble`,
`ensemble_unary`, the inner `tensorrt_llm`), the dynamic-batcher arm (`llm_ensemble`) and the OpenAI frontend
(`response_format`, `tools`, through the official openai client). Outputs are parsed with `json` and validated
with `jsonschema`; bad input is refused to that client only, and every engine ends quiescent (its pool whole).

One server for the module: `llm` and the two arms on SmolLM2; `llm_small` (SmolLM2 with a 14-block KV pool, to
force preemption); `llm_timeout` (tiny-llama, grammar_compile_timeout_ms=1: every new grammar runs past it).
"""
from __future__ import annotations

import functools
import json
import os
import queue
import re
import threading
import time

import jsonschema
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from grpc_helpers import infer_inputs
from engine_helpers import MODEL_REPOSITORY, SMOLLM2, TINY
from server_harness.openai_stack import FrontendProcess, scrape
from server_harness.quiescence import assert_quiescent
from server_harness.repository import build_repository, copy_model
from server_harness.server import TritonServer
from server_harness.stream_client import make_inputs
from serving.metrics_export import COUNTERS, HISTOGRAMS

pytestmark = pytest.mark.timeout(900)

LLM_BLOCKS, SMALL_BLOCKS, TIMEOUT_BLOCKS = 160, 14, 64
USER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}
ASK = "Describe a made-up user of a web shop as JSON: name, age, role, tags and address."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
# The grammar counters by their exported names (serving/metrics_export.py); a compile, refused or not, is one
# observation of the compile-time histogram.
_EXPORTED = {e.source: e.name for e in COUNTERS + HISTOGRAMS}
HITS, MISSES = _EXPORTED["grammar_cache_hits"], _EXPORTED["grammar_cache_misses"]
COMPILE_ERRORS = _EXPORTED["grammar_compile_errors"]
COMPILES = _EXPORTED["grammar_compile_seconds"] + "_count"
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    for folder in (SMOLLM2, TINY):
        if not os.path.exists(os.path.join(folder, "config.json")):
            pytest.skip(f"{folder} missing: run `make setup`")
    tmp = tmp_path_factory.mktemp("structured")
    engine = {"model": SMOLLM2, "num_kv_blocks": LLM_BLOCKS, "max_model_len": 1024}
    repo = build_repository(MODEL_REPOSITORY, tmp / "repo", engine)
    copy_model(MODEL_REPOSITORY, "llm", repo, params={**engine, "metrics_interval_ms": 200,
                                                      "cancel_check_period_ms": 50})
    for name in ("ensemble", "ensemble_unary"):
        copy_model(MODEL_REPOSITORY, name, repo)
    copy_model(MODEL_REPOSITORY, "tensorrt_llm", repo, params={"model": SMOLLM2})
    copy_model(MODEL_REPOSITORY, "llm", repo, as_name="llm_small", params={
        "model": SMOLLM2, "num_kv_blocks": SMALL_BLOCKS, "max_model_len": 224, "metrics_interval_ms": 200})
    copy_model(MODEL_REPOSITORY, "llm", repo, as_name="llm_timeout", params={
        "model": TINY, "num_kv_blocks": TIMEOUT_BLOCKS, "max_model_len": 256, "grammar_compile_timeout_ms": 1,
        "metrics_interval_ms": 200})
    server = TritonServer(repo, log_path=tmp / "server.log")
    with server:
        with FrontendProcess(server.grpc_url, tmp / "frontend.log") as frontend:
            yield server, frontend
    assert server.leftovers() == []


@pytest.fixture(scope="module")
def server(stack):
    return stack[0]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack[1].base_url}/v1", api_key="unused", max_retries=0, timeout=300)


# ---- a gRPC stream that keeps every sample's text (n) --------------------------------------------------

class Calls:
    """Requests on one stream, by id: each sample's whole text, the finish reasons, or the error."""

    def __init__(self, server: TritonServer):
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result=None, error=None: self.events.put((result, error)))
        self.texts: dict[str, list[str]] = {}
        self.reasons: dict[str, list[str]] = {}
        self.errors: dict[str, str] = {}
        self.pending: set[str] = set()

    def send(self, model: str, rid: str, prompt: str, **values) -> None:
        values = {"return_finish_reason": True, **values}
        self.texts[rid], self.pending = [], self.pending | {rid}
        self.client.async_stream_infer(model, make_inputs(prompt, values), request_id=rid)

    def wait(self, timeout_s: float = 400.0) -> "Calls":
        while self.pending:
            result, error = self.events.get(timeout=timeout_s)
            if result is None:
                msg = error.message()
                m = re.search(r"\(request id '([^']*)'\)$", msg)
                rid = m.group(1) if m else next(iter(self.pending))
                self.errors[rid] = msg
                self.pending.discard(rid)
                continue
            response = result.get_response()
            texts = [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
            mine = self.texts[response.id]
            mine += [""] * (len(texts) - len(mine))
            for i, t in enumerate(texts):
                mine[i] += t
            self.reasons[response.id] = [r.decode() for r in result.as_numpy("finish_reason").reshape(-1)]
            if response.parameters["triton_final_response"].bool_param:
                self.pending.discard(response.id)
        self.client.stop_stream()
        self.client.close()
        return self


def scraped(server, model: str, ok, timeout_s: float = 10.0) -> dict[str, float]:
    """/metrics for the model once `ok(metrics)` holds (the exporter publishes every 200 ms), or the last read."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server.metrics_url, model)
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def grown(server, model: str, before: dict[str, float], expected: dict[str, float],
          timeout_s: float = 10.0) -> dict[str, float]:
    """How much each counter named in `expected` has grown since `before` (a scrape taken before the requests under
    test), read once every one has grown at least that much or at the timeout: the caller compares it with
    `expected` exactly, so growth from any other request shows too."""
    def deltas(m: dict[str, float]) -> dict[str, float]:
        return {name: m.get(name, 0) - before.get(name, 0) for name in expected}
    return deltas(scraped(server, model, lambda m: all(deltas(m)[n] >= v for n, v in expected.items()), timeout_s))


@functools.lru_cache(maxsize=1)
def grammar_compiler():
    """An xgrammar compiler over SmolLM2's vocabulary, built as the engine builds its own (grammar/compiler.py:
    the model's vocabulary size, its end-of-sequence ids and the tokenizer's)."""
    import xgrammar as xgr
    from inflight.model.config import ModelConfig
    from inflight.tokenizer import load_tokenizer
    cfg, tokenizer = ModelConfig.from_dir(SMOLLM2), load_tokenizer(SMOLLM2)
    eos = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} - {None})
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=cfg.vocab_size, stop_token_ids=sorted(eos))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def assert_grammar_accepts(compile_grammar, text: str) -> None:
    """`text` (an output cut by max_tokens) is a prefix the grammar accepts: a matcher at the grammar's start takes
    it whole. compile_grammar: compiler -> CompiledGrammar, the same call the engine makes for the request."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(compile_grammar(grammar_compiler()))
    assert matcher.accept_string(text), f"not a prefix the request's grammar accepts: {text!r}"


def one(server, model: str, prompt: str, **values) -> tuple[str, str]:
    calls = Calls(server)
    calls.send(model, "r", prompt, **values)
    calls.wait()
    assert "r" not in calls.errors, calls.errors
    return calls.texts["r"][0], calls.reasons["r"][0]


def refused(server, model: str, prompt: str, **values) -> str:
    calls = Calls(server)
    calls.send(model, "bad", prompt, **values)
    calls.wait()
    assert "bad" in calls.errors, f"not refused: {calls.texts}"
    return calls.errors["bad"]


def so(**structured) -> str:
    return json.dumps({"structured_outputs": structured, "max_tokens": 160, "temperature": 0})


def valid_user(text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, USER)
    return obj


def trtllm_inputs(prompt: str, **extra) -> list[grpcclient.InferInput]:
    """As TensorRT-LLM's end_to_end_grpc_client.py builds them: [1, 1] arrays."""
    values = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[160]], dtype=np.int32),
              "temperature": np.array([[0.0]], dtype=np.float32),
              "apply_chat_template": np.array([[True]]), "exclude_input_in_output": np.array([[True]]), **extra}
    return infer_inputs(values)


def guide(kind: str, text: str = "") -> dict[str, np.ndarray]:
    out = {"guided_decoding_guide_type": np.array([[kind]], dtype=object)}
    if text:
        out["guided_decoding_guide"] = np.array([[text]], dtype=object)
    return out


def ensemble_text(server, model: str, inputs, with_reason: bool = False):
    """One request to a TensorRT-LLM-shaped model; its text (streamed models: the deltas joined), and its finish
    reason when asked (the request must ask for finish_reason)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if model == "ensemble_unary":
            return client.infer(model, inputs).as_numpy("text_output").reshape(-1)[0].decode()
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result=None, error=None: got.put((result, error)))
        client.async_stream_infer(model, inputs)
        parts, reason = [], None
        while True:
            result, error = got.get(timeout=400)
            if error is not None:
                raise RuntimeError(error.message())
            parts.append(result.as_numpy("text_output").reshape(-1)[0].decode())
            if result.as_numpy("finish_reason") is not None:
                reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
        return ("".join(parts), reason) if with_reason else "".join(parts)
    finally:
        client.close()


# ---- a JSON schema on every way in ------------------------------------------------------------------------

def test_json_schema_on_the_vllm_way_greedy_and_sampled_streamed_or_not(server):
    calls = Calls(server)
    calls.send("llm", "greedy", ASK, apply_chat_template=True, sampling_parameters=so(json=USER))
    calls.send("llm", "alias", ASK, apply_chat_template=True,  # vLLM's older name, the schema as JSON text
               sampling_parameters=json.dumps({"guided_decoding": {"json": json.dumps(USER)}, "max_tokens": 160,
                                               "temperature": 0}))
    calls.send("llm", "sampled", ASK, apply_chat_template=True, stream=True, sampling_parameters=json.dumps(
        {"structured_outputs": {"json": USER}, "max_tokens": 160, "temperature": 0.8, "top_p": 0.95, "seed": 7}))
    calls.send("llm", "streamed", ASK, apply_chat_template=True, stream=True, sampling_parameters=so(json=USER))
    calls.wait()
    assert not calls.errors, calls.errors
    for rid in ("greedy", "alias", "sampled", "streamed"):
        valid_user(calls.texts[rid][0])
        assert calls.reasons[rid] == ["stop"], (rid, calls.reasons[rid])  # the grammar ended it
    assert calls.texts["greedy"] == calls.texts["alias"] == calls.texts["streamed"]


def test_json_schema_on_the_tensorrt_llm_ways_and_the_dynamic_arm(server):
    schema = json.dumps(USER)
    texts = {model: ensemble_text(server, model, trtllm_inputs(ASK, **guide("json_schema", schema)))
             for model in ("ensemble", "ensemble_unary")}
    for text in texts.values():
        valid_user(text)
    dynamic, reason = one(server, "llm_ensemble", ASK, apply_chat_template=True, sampling_parameters=so(json=USER))
    valid_user(dynamic)
    assert reason == "stop"
    # TensorRT-LLM's "json": any JSON value (this one may run to max_tokens: then a JSON text cut short)
    inputs = trtllm_inputs("Reply with a JSON list of two colors.", return_finish_reason=np.array([[True]]),
                           **guide("json"))
    text, reason = ensemble_text(server, "ensemble", inputs, with_reason=True)
    if reason == "stop":
        json.loads(text)
    else:
        assert reason == "length", (reason, text)
        assert_grammar_accepts(lambda c: c.compile_builtin_json_grammar(), text)


def test_json_schema_through_openai_response_format_on_both_endpoints(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": USER, "strict": True}}
    chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": ASK}],
                                          response_format=fmt, max_tokens=160, temperature=0)
    valid_user(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="llm", messages=[{"role": "user", "content": ASK}],
                                                 response_format=fmt, max_tokens=160, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    completion = client.completions.create(model="llm", prompt="A user record in JSON: ", max_tokens=160,
                                           temperature=0, extra_body={"response_format": fmt})
    valid_user(completion.choices[0].text)
    anything = client.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "Reply with a JSON object whose key answer says yes."}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    text, reason = anything.choices[0].message.content, anything.choices[0].finish_reason
    if reason == "stop":  # any object; a long one may be cut by max_tokens, and then it is one's beginning
        assert isinstance(json.loads(text), dict)
    else:
        assert reason == "length", (reason, text)
        assert_grammar_accepts(lambda c: c.compile_json_schema('{"type": "object"}', any_whitespace=True), text)


def test_constrained_requests_leave_unconstrained_neighbours_byte_identical(server):
    prompts = ["The capital of France is", "Write a haiku about rain.", "List three fruits:"]
    plain = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    alone = Calls(server)
    for i, p in enumerate(prompts):
        alone.send("llm", f"u{i}", p, **plain)
    alone.wait()
    mixed = Calls(server)
    for i, p in enumerate(prompts):
        mixed.send("llm", f"c{i}", ASK, apply_chat_template=True, sampling_parameters=json.dumps(
            {"structured_outputs": {"json": USER}, "max_tokens": 160, "temperature": 0.7, "seed": i}))
        mixed.send("llm", f"u{i}", p, **plain)
    mixed.wait()
    assert not alone.errors and not mixed.errors
    for i in range(len(prompts)):
        assert mixed.texts[f"u{i}"] == alone.texts[f"u{i}"]
        valid_user(mixed.texts[f"c{i}"][0])


# ---- regex, choice, grammar, n, preemption ---------------------------------------------------------------

def test_regex_choice_and_grammar(server):
    date, _ = one(server, "llm", "When did the first moon landing happen? Answer with a date.",
                  apply_chat_template=True, sampling_parameters=so(regex=r"\d{4}-\d{2}-\d{2}"))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), date
    pick, reason = one(server, "llm", "Is the sky blue? Answer yes or no.", apply_chat_template=True,
                       sampling_parameters=so(choice=["yes", "no"]))
    assert pick in ("yes", "no") and reason == "stop"
    ebnf = 'root ::= "The answer is " [0-9] [0-9]? "."'
    text, _ = one(server, "llm", "What is 6 times 7?", apply_chat_template=True, sampling_parameters=so(grammar=ebnf))
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", text), text
    iso = r"\d{4}-\d{2}-\d{2}"
    trt = ensemble_text(server, "ensemble", trtllm_inputs("A date in ISO format:", **guide("regex", iso)))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", trt), trt


def test_tensorrt_llm_inner_model_takes_the_guide(server):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(SMOLLM2).encode("Is water wet? Answer yes or no: ")
    values = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[len(ids)]], dtype=np.int32),
              "request_output_len": np.array([[8]], dtype=np.int32),
              **guide("ebnf_grammar", 'root ::= "yes" | "no"')}
    inputs = infer_inputs(values)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        out = client.infer("tensorrt_llm", inputs)
    finally:
        client.close()
    length = int(out.as_numpy("sequence_length").reshape(-1)[0])
    new = out.as_numpy("output_ids").reshape(-1)[len(ids):length].tolist()
    text = AutoTokenizer.from_pretrained(SMOLLM2).decode(new, skip_special_tokens=True)
    assert text in ("yes", "no"), text


def test_n_samples_each_follow_the_schema(server):
    calls = Calls(server)
    calls.send("llm", "n3", ASK, apply_chat_template=True, sampling_parameters=json.dumps(
        {"structured_outputs": {"json": USER, "disable_any_whitespace": True}, "max_tokens": 160, "temperature": 1.0,
         "seed": 3, "n": 3}))
    calls.wait()
    assert "n3" not in calls.errors, calls.errors
    assert len(calls.texts["n3"]) == 3
    users = [valid_user(t) for t in calls.texts["n3"]]
    assert len({json.dumps(u) for u in users}) > 1  # three samples, not one copied


def test_a_preempted_constrained_request_still_follows_its_schema(server):
    before = scrape(server.metrics_url, "llm_small").get("vllm:num_preemptions_total", 0)
    calls = Calls(server)
    # 14 blocks of 16 tokens: three requests of ~100 prompt + up to 120 output tokens cannot all keep theirs.
    for i in range(3):
        calls.send("llm_small", f"p{i}", ASK, apply_chat_template=True, sampling_parameters=json.dumps(
            {"structured_outputs": {"json": USER}, "max_tokens": 120, "temperature": 0.5, "seed": i}))
    calls.wait()
    assert not calls.errors, calls.errors
    after = scraped(server, "llm_small", lambda m: m.get("vllm:num_preemptions_total", 0) > before)
    assert after.get("vllm:num_preemptions_total", 0) > before, "no preemption happened: the test lost its point"
    for i in range(3):
        if calls.reasons[f"p{i}"] == ["stop"]:
            valid_user(calls.texts[f"p{i}"][0])
        else:  # cut by max_tokens: what it has is still a prefix the grammar accepts
            assert calls.reasons[f"p{i}"] == ["length"], calls.reasons[f"p{i}"]
            assert_grammar_accepts(lambda c: c.compile_json_schema(json.dumps(USER), any_whitespace=True),
                                   calls.texts[f"p{i}"][0])
    assert_quiescent(server, "llm_small", SMALL_BLOCKS)


# ---- tool calling through the official openai client ---------------------------------------------------

def test_named_tool_call_arguments_follow_the_functions_schema(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.chat.completions.create(model="llm", messages=ask, tools=[WEATHER, TIME], max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # Streamed: the arguments arrive in pieces under one call id, as the openai client accumulates them.
    chunks = list(client.chat.completions.create(
        model="llm", messages=ask, tools=[WEATHER, TIME], max_tokens=80, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_call_and_a_second_turn_with_its_result(client):
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    r = client.chat.completions.create(model="llm", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    streamed = list(client.chat.completions.create(model="llm", messages=ask, tools=[WEATHER, TIME],
                                                   tool_choice="required", max_tokens=120, temperature=0, stream=True))
    calls = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # The call and its result go back in; the model answers in text (tool_choice auto, no call forced).
    first = choice.message.tool_calls[0]
    follow = client.chat.completions.create(model="llm", tools=[WEATHER, TIME], max_tokens=40, temperature=0,
                                            messages=ask + [choice.message.model_dump(exclude_none=True),
                                                            {"role": "tool", "tool_call_id": first.id,
                                                             "content": json.dumps({"time": "09:30"})}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls


# ---- bad input: refused to that client, nothing leaked ----------------------------------------------------

@pytest.mark.parametrize("structured, words", [
    ({"json": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}, ["if", "not supported"]),
    ({"json": {"type": "wizard"}}, ["structured_outputs.json", "'type'", "wizard"]),
    ({"regex": "[a-"}, ["structured_outputs.regex", "Unclosed"]),
    ({"grammar": "root ::= undefined_rule"}, ["structured_outputs.grammar", "undefined_rule"]),
    ({"choice": []}, ["structured_outputs.choice", "non-empty list"]),
    ({"json": {"type": "string", "enum": ["x" * 1000] * 40}}, ["structured_outputs", "at most 32768 bytes"]),
])
def test_bad_constraints_are_refused_by_name_on_the_vllm_way(server, structured, words):
    message = refused(server, "llm", "Hi", sampling_parameters=json.dumps({"structured_outputs": structured}))
    assert all(w in message for w in words), message


def test_bad_constraints_are_refused_on_the_other_ways_and_nothing_leaks(server, client):
    with pytest.raises(Exception) as e:
        ensemble_text(server, "ensemble", trtllm_inputs("Hi", **guide("regex", "(?=lookahead)x")))
    assert "guided_decoding_guide" in str(e.value) and "Lookahead" in str(e.value)
    with pytest.raises(Exception) as e:
        ensemble_text(server, "ensemble", trtllm_inputs("Hi", **guide("xml", "<a/>")))
    assert "guided_decoding_guide_type='xml'" in str(e.value)
    assert "regex" in refused(server, "llm_ensemble", "Hi", sampling_parameters=so(regex="[a-"))
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}})
    assert "not" in bad.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"guided_regex": "[a-"})
    # A compile that runs past grammar_compile_timeout_ms (1 ms here) is refused the same way.
    message = refused(server, "llm_timeout", "Hi", sampling_parameters=so(json=USER))
    assert "grammar_compile_timeout_ms=1" in message
    for model, blocks in (("llm", LLM_BLOCKS), ("llm_timeout", TIMEOUT_BLOCKS)):
        assert_quiescent(server, model, blocks)


def test_compile_time_and_cache_hits_are_on_metrics(server):
    """A grammar the library refuses, then one schema twice (new to this server): two compiles (one refused), two
    misses, one hit, counted by these requests alone."""
    before = scrape(server.metrics_url, "llm")
    refused(server, "llm", "Hi", sampling_parameters=so(regex="(unclosed"))
    for _ in range(2):
        one(server, "llm", "Pick a color.", sampling_parameters=so(choice=["red", "green", "blue"]))
    expected = {HITS: 1, MISSES: 2, COMPILES: 2, COMPILE_ERRORS: 1}
    assert grown(server, "llm", before, expected) == expected
    assert_quiescent(server, "llm", LLM_BLOCKS)


@pytest.mark.parametrize("concurrent", [True, False], ids=["at-once", "one-after-another"])
def test_one_schema_from_many_clients_is_compiled_once(server, concurrent):
    """The same schema (new to this server) from four clients, at once (a later one shares the compile under way,
    or finds it done) or one after another (they find it in the cache): one compile, three hits, every answer
    valid."""
    fruits = ["apple", "pear"] if concurrent else ["plum", "fig"]
    results: list[str] = []
    errors: list[str] = []

    def ask() -> None:
        try:
            results.append(one(server, "llm", "Pick a fruit.", sampling_parameters=so(choice=fruits))[0])
        except AssertionError as e:
            errors.append(str(e))

    before = scrape(server.metrics_url, "llm")
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
        if not concurrent:
            t.join()
    for t in threads:
        t.join()
    assert not errors and set(results) <= set(fruits) and len(results) == 4, (errors, results)
    expected = {COMPILES: 1, MISSES: 1, HITS: 3, COMPILE_ERRORS: 0}
    assert grown(server, "llm", before, expected) == expected
