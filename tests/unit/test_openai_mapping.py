"""The OpenAI frontend's translation layer without a server: request mapping, tensors, SSE bodies, errors."""
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from openai_frontend.app import Choices, create_app
from openai_frontend.errors import APIError, from_triton
from openai_frontend.protocol import parse_chat, parse_completion
from openai_frontend.responses import DONE, ResponseBuilder, sse
from openai_frontend.triton_io import (Delta, ModelInfo, build_request, find_tokenizer_dir, openai_finish_reason,
                                       parse_response)

# What `get_model_config(as_json=True)["config"]` returns for a model shaped like ours (trimmed).
LLM_CONFIG = {
    "name": "llm", "max_batch_size": 0,
    "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
              {"name": "stream", "data_type": "TYPE_BOOL", "dims": ["1"]},
              {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": ["1"]},
              {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": ["1"]},
              {"name": "temperature", "data_type": "TYPE_FP32", "dims": ["1"]},
              {"name": "top_k", "data_type": "TYPE_INT32", "dims": ["1"]},
              {"name": "seed", "data_type": "TYPE_UINT64", "dims": ["1"]},
              {"name": "stop_words", "data_type": "TYPE_STRING", "dims": ["-1"]},
              {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": ["1"]},
              {"name": "return_finish_reason", "data_type": "TYPE_BOOL", "dims": ["1"]},
              {"name": "return_num_input_tokens", "data_type": "TYPE_BOOL", "dims": ["1"]},
              {"name": "return_num_output_tokens", "data_type": "TYPE_BOOL", "dims": ["1"]}],
    "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["-1"]},
               {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": ["1"]}],
    "parameters": {"model": {"string_value": "/nonexistent"}},
}


def status_of(fn, *args):
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


# ---- request parsing ------------------------------------------------------------------------------

def test_max_tokens_left_unset_so_the_model_default_applies():
    req = parse_completion({"model": "llm", "prompt": "hi"})
    assert "max_tokens" not in req.sampling and req.sampling == {}


def test_max_completion_tokens_wins_over_legacy_max_tokens():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "max_tokens": 5, "max_completion_tokens": 9})
    assert req.sampling["max_tokens"] == 9


def test_sampling_fields_map_to_contract_names_and_types():
    req = parse_completion({"model": "m", "prompt": "p", "temperature": 0, "top_p": 0.5, "top_k": 3.0,
                            "seed": 7, "stop": "\n", "presence_penalty": 0.1, "min_p": 0.2, "ignore_eos": True})
    assert req.sampling == {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": 7, "stop_words": ["\n"],
                            "presence_penalty": 0.1, "min_p": 0.2, "ignore_eos": True}
    assert isinstance(req.sampling["top_k"], int)


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"n": 2.5}, "n"),
    ({"logprobs": 21}, "logprobs"),  # vLLM's max_logprobs, 20
    ({"logprobs": 1.5}, "logprobs"),
    ({"logprobs": 1, "echo": True}, "logprobs"),  # the prompt's logprobs are not reported
    ({"best_of": 3}, "best_of"),
    ({"suffix": "tail"}, "suffix"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": ""}, "model"),
])
def test_completion_refusals_are_400_naming_the_parameter(body, param):
    err = status_of(parse_completion, {"model": "m", "prompt": "p", **body})
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"


def test_single_prompt_in_a_list_is_accepted_and_echo_kept():
    req = parse_completion({"model": "m", "prompt": ["only"], "echo": True, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert (req.prompt, req.echo, req.stream, req.include_usage) == ("only", True, True, True)


def test_chat_messages_text_parts_joined_and_developer_is_system():
    req = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    assert req.is_chat


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"tool_choice": "auto"},  # no tools to choose from
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": []},
    {"logprobs": True, "top_logprobs": 21},
    {"top_logprobs": 3},  # without logprobs: true
    {"logprobs": 1},  # chat's is a boolean
    {"functions": [{"name": "f"}]},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
     "response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
])
def test_chat_unsupported_content_is_a_clear_400(body):
    full = {"model": "m", "messages": [{"role": "user", "content": "x"}], **body}
    err = status_of(parse_chat, full)
    assert err.status == 400 and err.message


def test_chat_harmless_defaults_pass():
    parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "n": 1, "logprobs": False, "user": "u"})


# ---- tensors ----------------------------------------------------------------------------------------

def test_declared_inputs_become_tensors_the_rest_rides_in_sampling_parameters():
    info = ModelInfo.from_config(LLM_CONFIG)
    req = parse_completion({"model": "llm", "prompt": "héllo", "temperature": 0, "seed": 3, "min_p": 0.1,
                            "stop": ["a", "bc"], "presence_penalty": 0.5})
    tensors, params = build_request(info, req.prompt, req.sampling)
    assert params == {}
    assert tensors["text_input"].tolist() == ["héllo".encode()]
    assert tensors["temperature"].dtype == np.float32 and tensors["seed"].dtype == np.uint64
    assert tensors["stop_words"].tolist() == [b"a", b"bc"]
    assert tensors["stream"].tolist() == [True] and tensors["exclude_input_in_output"].tolist() == [True]
    # Not declared: must not be sent as tensors (Triton would refuse an unknown input).
    assert set(tensors) <= set(info.inputs)
    assert json.loads(tensors["sampling_parameters"][0]) == {"min_p": 0.1, "presence_penalty": 0.5}
    assert "max_tokens" not in tensors


def test_aliases_batch_dim_and_request_parameter_fallback():
    cfg = {"name": "trt", "max_batch_size": 8,
           "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": ["1"]},
                     {"name": "request_output_len", "data_type": "TYPE_INT32", "dims": ["1"]},
                     {"name": "runtime_top_k", "data_type": "TYPE_INT32", "dims": ["1"]}],
           "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": ["-1"]}]}
    info = ModelInfo.from_config(cfg)
    tensors, params = build_request(info, "p", {"max_tokens": 4, "top_k": 2, "temperature": 0.0})
    assert tensors["request_output_len"].shape == (1, 1) and tensors["runtime_top_k"].tolist() == [[2]]
    assert params["temperature"] == 0.0 and params["stream"] is True
    with pytest.raises(APIError) as e:  # a list cannot travel as a request parameter
        build_request(info, "p", {"stop_words": ["x"]})
    assert e.value.status == 400 and e.value.param == "stop_words"


def test_integer_beyond_the_declared_type_is_400_not_an_overflow():
    info = ModelInfo.from_config(LLM_CONFIG)
    with pytest.raises(APIError) as e:
        build_request(info, "p", {"top_k": 2**40})
    assert e.value.status == 400 and "out of range" in e.value.message


def test_model_info_contract_detection_and_tokenizer_dir(tmp_path):
    model_dir = tmp_path / "models" / "tiny"
    model_dir.mkdir(parents=True)
    (model_dir / "tokenizer_config.json").write_text("{}")
    cfg = dict(LLM_CONFIG, parameters={"max_model_len": {"string_value": "512"},
                                       "model": {"string_value": "models/tiny"}})
    info = ModelInfo.from_config(cfg, [tmp_path / "elsewhere", tmp_path])
    assert info.speaks_contract and info.tokenizer_dir == str(model_dir.resolve())
    assert find_tokenizer_dir({"model": "models/tiny"}, [tmp_path / "nowhere"]) is None
    no_text = dict(LLM_CONFIG, output=[{"name": "logits", "data_type": "TYPE_FP32", "dims": ["-1"]}])
    assert not ModelInfo.from_config(no_text).speaks_contract


def test_parse_response_reads_optional_outputs():
    outs = {"text_output": np.array([b"ab\xc3\xa9"], dtype=object),
            "finish_reason": np.array([b"length"], dtype=object),
            "num_input_tokens": np.array([5], dtype=np.int32), "num_output_tokens": np.array([[3]], dtype=np.int32)}
    assert parse_response(outs.get) == [Delta("abé", "length", 5, 3)]
    assert parse_response({"text_output": np.array([b"x"], dtype=object)}.get) == [Delta("x", None, None, None)]


def test_parse_response_splits_samples_and_reads_none_as_unfinished():
    outs = {"text_output": np.array([b"a", b"b"], dtype=object),
            "finish_reason": np.array([b"None", b"length"], dtype=object),
            "num_input_tokens": np.array([4], dtype=np.uint32), "num_output_tokens": np.array([1, 2], dtype=np.uint32)}
    assert parse_response(outs.get) == [Delta("a", None, 4, 1, 0), Delta("b", "length", 4, 2, 1)]


def test_finish_reasons_map_to_openai():
    assert openai_finish_reason("eos") == "stop" and openai_finish_reason("stop") == "stop"
    assert openai_finish_reason("length") == "length"
    with pytest.raises(APIError) as e:
        openai_finish_reason("cancelled")
    assert e.value.status == 503
    with pytest.raises(APIError) as e:
        openai_finish_reason("error")
    assert e.value.status == 500


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("message,status_code,expected,param", [
    ("temperature=500.0 is out of range: allowed a number in [0, 100]", None, 400, "temperature"),
    ("stop_words=<40 words> is invalid: allowed at most 32 words", None, 400, "stop"),
    ("queue is full: 9 requests waiting, max_queue_size=8", None, 503, None),
    ("server is shutting down", None, 503, None),
    ("Request for unknown model: 'nope' is not found", None, 404, "model"),
    ("engine error: RuntimeError: invalid shape", None, 500, None),
    ("something odd", "StatusCode.UNAVAILABLE", 503, None),
    ("something odd", "StatusCode.INVALID_ARGUMENT", 400, None),
    ("something odd", None, 500, None),
])
def test_triton_errors_classified(message, status_code, expected, param):
    err = from_triton(message, status_code)
    assert err.status == expected and err.param == param
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"] == message


# ---- response bodies -------------------------------------------------------------------------------

def decode(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):])


def test_chat_stream_chunks_have_openai_shape():
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}})
    b = ResponseBuilder(req)
    role = decode(sse(b.role_chunk()))
    assert role["object"] == "chat.completion.chunk" and role["id"].startswith("chatcmpl-")
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""} and role["usage"] is None
    mid = decode(sse(b.chunk("é")))
    assert mid["choices"][0] == {"index": 0, "delta": {"content": "é"}, "logprobs": None, "finish_reason": None}
    last = decode(sse(b.chunk("", "length")))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    use = decode(sse(b.usage_chunk({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5})))
    assert use["choices"] == [] and use["usage"]["total_tokens"] == 5
    assert len({role["id"], mid["id"], last["id"], use["id"]}) == 1
    assert "é" in sse(b.chunk("é"))  # UTF-8 on the wire, not \u escapes
    assert DONE == "data: [DONE]\n\n"


def test_completion_bodies_and_no_usage_key_without_include_usage():
    req = parse_completion({"model": "m", "prompt": "p", "stream": True})
    b = ResponseBuilder(req)
    c = b.chunk("t")
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == "t" and "usage" not in c
    full = ResponseBuilder(parse_completion({"model": "m", "prompt": "p"})).full([("out", "stop", [])], {"x": 1})
    assert full["choices"][0] == {"index": 0, "text": "out", "logprobs": None, "finish_reason": "stop"}
    chat = ResponseBuilder(parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    body = chat.full([("hi", "stop", []), ("yo", "length", [])], {})
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["choices"][1]["message"]["content"] == "yo"
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hi"}


def test_choices_sum_streamed_output_counts_and_keep_echo_prefix():
    choices = Choices(2, "prompt ")
    choices.add([Delta("a", None, 4, 1, 0), Delta("x", None, 4, 1, 1)])
    choices.add([Delta("", None, None, None, 0)])
    # a response carrying two tokens (a held-back multi-byte character)
    choices.add([Delta("bc", "eos", 4, 2, 0), Delta("", "length", 4, 0, 1)])
    first = choices.all[0]
    assert first.text == "prompt abc" and first.finish_reason == "eos" and choices.finished
    assert choices.usage() == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


# ---- HTTP layer without a server: refusals happen before any gRPC call -------------------------------

@pytest.fixture
def http():
    # A port nothing listens on: these requests must be answered without reaching Triton.
    with TestClient(create_app("127.0.0.1:9")) as client:
        yield client


def test_http_bad_json_and_bad_params_are_openai_shaped_400(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "n": "three"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_http_unknown_route_is_openai_shaped_404(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_http_unreachable_triton_is_not_a_crash(http):
    assert http.get("/health").status_code == 503
    r = http.post("/v1/completions", json={"model": "m", "prompt": "p"})
    # Unreachable is "try again later", not "no such model".
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
