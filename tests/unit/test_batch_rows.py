"""TensorRT-LLM shapes <-> the llm model's (serving.batch_rows), without Triton."""
import numpy as np
import pytest

from inflight.fields import InvalidRequestError
from serving.batch_rows import row_outputs, split_rows, stack_rows, with_trtllm_defaults


def test_rows_drop_the_batch_dimension():
    rows = split_rows({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                       "max_tokens": np.array([[3], [5]], dtype=np.int32),
                       "stop_words": np.array([[b"x", b""], [b"y", b"z"]], dtype=np.object_)})
    assert [r["text_input"].tolist() for r in rows] == [[b"a"], [b"b"]]
    assert [r["max_tokens"].tolist() for r in rows] == [[3], [5]]
    assert rows[1]["stop_words"].tolist() == [b"y", b"z"]


def test_a_batch_size_mismatch_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match=r"max_tokens=<tensor of shape \[1, 1\]>"):
        split_rows({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_),
                    "max_tokens": np.array([[3]], dtype=np.int32)})


def test_one_response_in_tensorrt_llm_shapes():
    out = row_outputs({"text_output": np.array([b"hi"], dtype=np.object_),
                       "cum_log_probs": np.array([-1.5], dtype=np.float32),
                       "output_log_probs": np.array([[-1.0, -0.5]], dtype=np.float32)}, batch_index=3)
    assert out["text_output"].shape == (1,) and out["text_output"][0] == b"hi"
    assert out["batch_index"].tolist() == [[3]] and out["sequence_index"].tolist() == [[0]]
    assert out["cum_log_probs"].shape == (1, 1) and out["output_log_probs"].shape == (1, 1, 2)


def test_unary_rows_stack_batch_first_and_pad_log_probs():
    a = row_outputs({"text_output": np.array([b"a"], dtype=np.object_),
                     "output_log_probs": np.array([[-1.0]], dtype=np.float32)}, 0)
    b = row_outputs({"text_output": np.array([b"bb"], dtype=np.object_),
                     "output_log_probs": np.array([[-1.0, -2.0]], dtype=np.float32)}, 1)
    out = stack_rows([a, b])
    assert out["text_output"].tolist() == [b"a", b"bb"]
    assert out["output_log_probs"].shape == (2, 1, 2) and out["output_log_probs"][0, 0].tolist() == [-1.0, 0.0]


def test_tensorrt_llm_defaults_fill_only_what_the_client_left_out():
    row = {"text_input": np.array([b"a"], dtype=np.object_), "temperature": np.array([0.8], dtype=np.float32)}
    filled = with_trtllm_defaults(row, {})
    assert filled["exclude_input_in_output"].tolist() == [False]  # its ensemble echoes the prompt
    assert filled["temperature"].tolist() == [0.0]  # temperature alone does not sample in TensorRT-LLM
    sampled = with_trtllm_defaults({**row, "runtime_top_k": np.array([5], dtype=np.int32),
                                    "exclude_input_in_output": np.array([True])}, {})
    assert sampled["temperature"].tolist() == [np.float32(0.8)]
    assert sampled["exclude_input_in_output"].tolist() == [True]


def test_a_tensorrt_llm_stream_drops_the_echo_flag():
    row = {"text_input": np.array([b"a"], dtype=np.object_), "stream": np.array([True]),
           "exclude_input_in_output": np.array([False])}
    assert "exclude_input_in_output" not in with_trtllm_defaults(row, {})
