"""The request contract (backend_src/serving/contract.py): every convention, coercion, conflict and cap."""
import json

import numpy as np
import pytest

from inflight.fields import InvalidRequestError, RequestLimits
from serving.contract import INPUT_NAMES, parse_request


def text(prompt="Hello"):
    return {"text_input": np.array([prompt.encode("utf-8")], dtype=np.object_)}


def sp(obj):
    raw = obj if isinstance(obj, (str, bytes)) else json.dumps(obj)
    return np.array([raw.encode() if isinstance(raw, str) else raw], dtype=np.object_)


def i32(v):
    return np.array([v], dtype=np.int32)


def f32(v):
    return np.array([v], dtype=np.float32)


def flag(v):
    return np.array([v], dtype=np.bool_)


def words(*ws):
    return np.array([w.encode() for w in ws], dtype=np.object_)


def refused(inputs, parameters=None, limits=RequestLimits()):
    with pytest.raises(InvalidRequestError) as info:
        parse_request(inputs, parameters, limits)
    return str(info.value)


# ---- defaults ----------------------------------------------------------------------------------

def test_defaults():
    req = parse_request(text("Hi"))
    assert req.prompt == "Hi"
    assert req.stream is False and req.exclude_input_in_output is True and req.cancel is False
    assert req.priority == 0
    assert not (req.return_finish_reason or req.return_num_input_tokens or req.return_num_output_tokens
                or req.return_logprobs)
    p = req.params
    assert p.max_tokens is None  # the engine's default_max_tokens applies, never a hidden 16
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1 and p.seed is None
    assert p.stop == [] and p.bad_words == [] and p.ignore_eos is False


def test_prompt_keeps_unicode_exactly():
    prompt = "  你好，世界 😀\n\tend "
    assert parse_request(text(prompt)).prompt == prompt


# ---- the vLLM convention -----------------------------------------------------------------------

def test_vllm_sampling_parameters_json_with_string_numbers():
    # genai-perf's vllm backend sends numbers as strings.
    req = parse_request({**text(), "sampling_parameters": sp({"max_tokens": "12", "min_tokens": "3",
                                                              "temperature": "0.5", "top_p": "0.9", "top_k": "40",
                                                              "seed": "7", "ignore_eos": "true",
                                                              "stop": ["\n\n", "END"]}),
                         "stream": flag(False), "exclude_input_in_output": flag(False)})
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (12, 3, 0.5, 0.9, 40, 7)
    assert p.ignore_eos is True and p.stop == ["\n\n", "END"]
    assert req.stream is False and req.exclude_input_in_output is False


def test_vllm_json_penalties_and_extras():
    req = parse_request({**text(), "sampling_parameters": sp({
        "repetition_penalty": 1.2, "presence_penalty": -0.5, "frequency_penalty": 0.5, "min_p": 0.1,
        "stop_token_ids": [2, 3], "bad_words": "xyz", "skip_special_tokens": False, "logprobs": 2, "n": 3})})
    p = req.params
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p) == (1.2, -0.5, 0.5, 0.1)
    assert p.stop_token_ids == [2, 3] and p.bad_words == ["xyz"] and p.skip_special_tokens is False
    assert p.logprobs == 2 and req.logprobs_requested and p.n == 3  # vLLM: how many top logprobs per token


def test_vllm_output_flags_are_separate():
    req = parse_request({**text(), "return_cumulative_logprob": flag(True)})
    assert req.return_cumulative_logprob and not req.return_logprobs
    # The sampled tokens' own logprobs are needed, but the client asked for no top logprobs: output says null.
    assert req.params.logprobs == 0 and not req.logprobs_requested
    assert parse_request(text()).params.logprobs is None  # nothing asked: nothing computed


def test_vllm_stop_string_as_request_parameter():
    assert parse_request(text(), {"stop": "\n"}).params.stop == ["\n"]
    assert parse_request(text(), {"stop": ["a", "b"]}).params.stop == ["a", "b"]
    assert parse_request(text(), {"stop": "true"}).cancel is False  # text is a stop word, not a flag


# ---- the TensorRT-LLM convention ----------------------------------------------------------------

def test_trtllm_tensor_names():
    req = parse_request({**text(), "request_output_len": i32(20), "min_length": i32(4),
                         "runtime_top_p": f32(0.5), "runtime_top_k": i32(3),
                         "random_seed": np.array([2**64 - 1], dtype=np.uint64), "streaming": flag(True),
                         "stop_words": words("foo", "bar baz"), "bad_words": words("qux"),
                         "repetition_penalty": f32(1.5), "presence_penalty": f32(0.25),
                         "frequency_penalty": f32(-0.25), "temperature": f32(0.0)})
    p = req.params
    assert (p.max_tokens, p.min_tokens, p.top_p, p.top_k, p.seed) == (20, 4, 0.5, 3, 2**64 - 1)
    assert p.stop == ["foo", "bar baz"] and p.bad_words == ["qux"] and p.is_greedy
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.5, 0.25, -0.25)
    assert req.stream is True


def test_trtllm_stop_true_is_a_cancel_flag_and_needs_no_prompt():
    req = parse_request({"text_input": np.array([b""], dtype=np.object_)}, {"stop": True})
    assert req.cancel is True and req.params.stop == []
    assert parse_request(text(), {"stop": False}).cancel is False


def test_genai_perf_tensorrtllm_payload():
    req = parse_request({**text(), "max_tokens": i32(256), "exclude_input_in_output": flag(True),
                         "stream": flag(True), "min_length": i32(256), "ignore_eos": flag(True)})
    assert req.params.max_tokens == 256 and req.params.min_tokens == 256 and req.params.ignore_eos


# ---- every field as a tensor, a parameter and a JSON key ---------------------------------------

@pytest.mark.parametrize("name,tensor,param,expect", [
    ("max_tokens", i32(9), 9, ("params", "max_tokens", 9)),
    ("min_tokens", i32(2), "2", ("params", "min_tokens", 2)),
    ("temperature", f32(0.25), 0.25, ("params", "temperature", 0.25)),
    ("top_p", f32(0.5), "0.5", ("params", "top_p", 0.5)),
    ("top_k", i32(5), 5, ("params", "top_k", 5)),
    ("seed", np.array([11], dtype=np.uint64), 11, ("params", "seed", 11)),
    ("repetition_penalty", f32(1.25), 1.25, ("params", "repetition_penalty", 1.25)),
    ("ignore_eos", flag(True), True, ("params", "ignore_eos", True)),
    ("stream", flag(True), "true", ("req", "stream", True)),
    ("exclude_input_in_output", flag(False), False, ("req", "exclude_input_in_output", False)),
    ("priority", i32(-3), -3, ("req", "priority", -3)),
    ("return_finish_reason", flag(True), 1, ("req", "return_finish_reason", True)),
    ("return_num_input_tokens", flag(True), True, ("req", "return_num_input_tokens", True)),
    ("return_num_output_tokens", flag(True), True, ("req", "return_num_output_tokens", True)),
    ("return_logprobs", flag(True), True, ("req", "return_logprobs", True)),
    ("stop_words", words("zz"), "zz", ("params", "stop", ["zz"])),
])
def test_each_field_from_every_source(name, tensor, param, expect):
    where, attr, value = expect
    for req in (parse_request({**text(), name: tensor}),
                parse_request(text(), {name: param}),
                parse_request({**text(), "sampling_parameters": sp({name: param})})):
        got = getattr(req.params if where == "params" else req, attr)
        assert got == pytest.approx(value) if isinstance(value, float) else got == value


def test_same_value_from_several_sources_is_fine():
    req = parse_request({**text(), "max_tokens": i32(7), "sampling_parameters": sp({"max_tokens": "7"})},
                        {"request_output_len": 7})
    assert req.params.max_tokens == 7


@pytest.mark.parametrize("inputs,params", [
    ({"max_tokens": i32(7), "request_output_len": i32(8)}, {}),
    ({"max_tokens": i32(7), "sampling_parameters": sp({"max_tokens": 8})}, {}),
    ({"stream": flag(True)}, {"streaming": False}),
])
def test_conflicting_values_are_refused(inputs, params):
    msg = refused({**text(), **inputs}, params)
    assert "conflicts" in msg


def test_declared_inputs_have_no_stop():
    assert "stop" not in INPUT_NAMES and "text_input" in INPUT_NAMES


# ---- refusals: each names the field, the value and what is allowed ------------------------------

def test_missing_text_input():
    msg = refused({"max_tokens": i32(4)})
    assert "text_input" in msg and "missing" in msg


def test_wrong_dtype_text_input():
    msg = refused({"text_input": np.array([3], dtype=np.int32)})
    assert "text_input" in msg and "int32" in msg and "BYTES" in msg


def test_two_prompts_in_one_request():
    msg = refused({"text_input": np.array([b"a", b"b"], dtype=np.object_)})
    assert "text_input" in msg and "[2]" in msg and "exactly one" in msg


def test_invalid_utf8_prompt():
    msg = refused({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)})
    assert "text_input" in msg and "UTF-8" in msg


def test_invalid_json():
    msg = refused({**text(), "sampling_parameters": sp("{max_tokens: 3")})
    assert "sampling_parameters" in msg and "{max_tokens: 3" in msg and "JSON" in msg


def test_json_not_an_object():
    msg = refused({**text(), "sampling_parameters": sp("[1, 2]")})
    assert "sampling_parameters" in msg and "JSON object" in msg


def test_unknown_sampling_key_names_key_and_allowed_keys():
    msg = refused({**text(), "sampling_parameters": sp({"max_tokens": 3, "best_of": 2})})
    assert "'best_of'" in msg and "max_tokens" in msg and "temperature" in msg


def test_unknown_request_parameter():
    msg = refused(text(), {"tempreature": 0.5})
    assert "'tempreature'" in msg and "temperature" in msg


def test_unknown_input_tensor():
    msg = refused({**text(), "lora_task_id": i32(2)})
    assert "'lora_task_id'" in msg and "text_input" in msg


def test_trtllm_client_defaults_are_accepted():
    """What end_to_end_grpc_client.py sends when it uses none of these features, with its [1, 1] shapes."""
    req = parse_request({"text_input": np.array([[b"Hi"]], dtype=np.object_), "max_tokens": np.array([[8]], np.int32),
                         "beam_width": np.array([[1]], np.int32), "temperature": np.array([[1.0]], np.float32),
                         "bad_words": np.array([[b""]], np.object_), "stop_words": np.array([[b""]], np.object_),
                         "embedding_bias_words": np.zeros((1, 0), np.object_),
                         "embedding_bias_weights": np.zeros((1, 0), np.float32),
                         "num_return_sequences": np.array([[1]], np.int32), "end_id": np.array([[2]], np.int32),
                         "pad_id": np.array([[2]], np.int32), "exclude_input_in_output": np.array([[False]])})
    assert req.prompt == "Hi" and req.params.max_tokens == 8 and req.params.stop == [] and req.params.bad_words == []
    assert req.params.end_id == 2 and req.pad_id == 2 and req.params.n == 1


@pytest.mark.parametrize("name,value,why", [
    ("beam_width", 4, "beam search is not implemented"),
    ("length_penalty", 0.5, "beam search only"),
    ("embedding_bias_words", ["x"], "logit bias"),
    ("return_context_logits", True, "logits are not returned"),
])
def test_trtllm_features_we_lack_are_refused_by_name(name, value, why):
    msg = refused(text(), {name: value})
    assert msg.startswith(f"{name}=") and "is not supported" in msg and why in msg


@pytest.mark.parametrize("field,value,needle", [
    ("temperature", -1, "temperature=-1"),
    ("temperature", "hot", "temperature='hot'"),
    ("temperature", float("nan"), "temperature=nan"),
    ("top_p", 0, "top_p=0"),
    ("top_p", 1.5, "top_p=1.5"),
    ("top_k", -2, "top_k=-2"),
    ("max_tokens", 0, "max_tokens=0"),
    ("max_tokens", 2.5, "max_tokens=2.5"),
    ("max_tokens", True, "max_tokens=True"),
    ("max_tokens", "ten", "max_tokens='ten'"),
    ("min_tokens", -1, "min_tokens=-1"),
    ("seed", -1, "seed=-1"),
    ("seed", 2**64, "seed=18446744073709551616"),
    ("repetition_penalty", 0, "repetition_penalty=0"),
    ("presence_penalty", 3, "presence_penalty=3"),
    ("frequency_penalty", -2.5, "frequency_penalty=-2.5"),
    ("priority", 2**31, "priority=2147483648"),
    ("ignore_eos", "maybe", "ignore_eos='maybe'"),
    ("stream", 2, "stream=2"),
    ("stop", 5, "stop=5"),
    ("stop", [3], "stop=3"),
    ("stop_token_ids", [-1], "stop_token_ids=-1"),
])
def test_bad_values_name_field_value_and_range(field, value, needle):
    msg = refused({**text(), "sampling_parameters": sp({field: value})})
    assert needle in msg and "allowed" in msg


def test_min_tokens_above_max_tokens():
    msg = refused({**text(), "max_tokens": i32(3), "min_tokens": i32(5)})
    assert "min_tokens=5" in msg and "max_tokens=3" in msg


def test_tensor_with_two_elements_for_a_scalar_field():
    msg = refused({**text(), "max_tokens": np.array([1, 2], dtype=np.int32)})
    assert "max_tokens" in msg and "exactly one element" in msg


def test_stop_true_inside_json_is_not_a_cancel():
    msg = refused({**text(), "sampling_parameters": sp({"stop": True})})
    assert "stop=True" in msg and "string" in msg


# ---- abuse caps, checked before any tokenizing (the prompt's own: tests/unit/test_prompt_caps.py) ------

def test_json_size_cap():
    limits = RequestLimits(max_json_bytes=32)
    msg = refused({**text(), "sampling_parameters": sp({"stop": ["x" * 40]})}, limits=limits)
    assert "sampling_parameters" in msg and "at most 32 bytes" in msg


def test_stop_word_count_and_size_caps():
    limits = RequestLimits(max_stop_words=2, max_word_bytes=4)
    assert parse_request({**text(), "stop_words": words("ab", "cd")}, limits=limits).params.stop == ["ab", "cd"]
    assert "at most 2 words" in refused({**text(), "stop_words": words("a", "b", "c")}, limits=limits)
    assert "at most 4 bytes" in refused({**text(), "bad_words": words("abcde")}, limits=limits)
    assert "at most 2 words" in refused(text(), {"stop": ["a", "b", "c"]}, limits=limits)


def test_limits_validate_themselves():
    with pytest.raises(ValueError, match="max_json_bytes=0"):
        RequestLimits(max_json_bytes=0)


def test_asking_a_stream_to_repeat_the_prompt_is_refused():
    """vLLM's backend refuses it; a stream never repeats the prompt (the TensorRT-LLM front drops the flag)."""
    msg = refused({**text(), "stream": flag(True), "exclude_input_in_output": flag(False)})
    assert msg.startswith("exclude_input_in_output=False is not allowed when streaming")
    assert parse_request({**text(), "stream": flag(True)}, defaults={"exclude_input_in_output": False}).stream
