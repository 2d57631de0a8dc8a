"""TensorRT-LLM's clients on the real tritonserver: `ensemble` (decoupled) and `ensemble_unary` take its
shapes ([B, 1] inputs on a batching model, one response per row with batch_index), its input names and its
defaults, and answer what `llm` answers. Requests are built as its end-to-end gRPC client builds them."""
from __future__ import annotations

import queue
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from grpc_helpers import infer_inputs
from engine_helpers import MODEL_REPOSITORY, TINY
from server_harness.openai_stack import grpc_generate
from server_harness.repository import copy_model
from server_harness.server import TritonServer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("trtllm") / "repo"
    copy_model(MODEL_REPOSITORY, "llm", repo, params={"model": TINY, "num_kv_blocks": 128, "max_model_len": 256})
    for name in ("ensemble", "ensemble_unary", "tensorrt_llm", "trtllm_preprocessing", "trtllm_postprocessing"):
        copy_model(MODEL_REPOSITORY, name, repo, params={"model": TINY} if name != "ensemble"
                   and name != "ensemble_unary" else None)
    srv = TritonServer(repo, log_path=repo.parent / "server.log", env={"OMP_NUM_THREADS": "1"})
    with srv:
        yield srv
    assert srv.leftovers() == []


def trtllm_inputs(prompts: list[str], max_tokens: int, streaming: bool, **extra) -> list[grpcclient.InferInput]:
    """As end_to_end_grpc_client.py prepares them: [B, 1] arrays, empty bias lists, beam_width 1."""
    values = {
        "text_input": np.array([[p] for p in prompts]).astype(object),
        "max_tokens": np.full((len(prompts), 1), max_tokens, dtype=np.int32),
        "stream": np.full((len(prompts), 1), streaming, dtype=bool),
        "beam_width": np.ones((len(prompts), 1), dtype=np.int32),
        "temperature": np.zeros((len(prompts), 1), dtype=np.float32),
        "embedding_bias_words": np.zeros((len(prompts), 0)).astype(object),
        "embedding_bias_weights": np.zeros((len(prompts), 0), dtype=np.float32),
        "exclude_input_in_output": np.ones((len(prompts), 1), dtype=bool),
        **extra,
    }
    return infer_inputs(values)


def stream(server, inputs, outputs=("text_output", "batch_index")):
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), got))
    client.async_stream_infer("ensemble", inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs],
                              request_id="trt")
    client.stop_stream()
    client.close()
    results = []
    while not got.empty():
        results.append(got.get())
    return results


def test_batched_streaming_rows_come_back_by_batch_index_and_match_llm(server):
    prompts = ["The capital of France is", "Once upon a time"]
    results = stream(server, trtllm_inputs(prompts, 6, streaming=True))
    assert all(error is None for _, error in results), [e for _, e in results if e]
    texts = ["", ""]
    for result, _ in results:
        index = int(result.as_numpy("batch_index")[0][0])
        texts[index] += result.as_numpy("text_output")[0].decode()
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in results]
    assert finals.count(True) == 1 and finals[-1]
    for prompt, text in zip(prompts, texts):
        expected, _ = grpc_generate(server.grpc_url, "llm", prompt, max_tokens=6, temperature=0.0)
        assert text == expected and text


def test_log_probs_in_tensorrt_llm_shapes(server):
    results = stream(server, trtllm_inputs(["Hello"], 4, streaming=False,
                                           return_log_probs=np.ones((1, 1), dtype=bool)),
                     outputs=("text_output", "cum_log_probs", "output_log_probs"))
    (result, error), = results
    assert error is None
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape == (1, 1, 4) and result.as_numpy("cum_log_probs").shape == (1, 1)
    assert np.isclose(result.as_numpy("cum_log_probs")[0, 0], per_token.sum(), rtol=1e-4)


def test_a_feature_we_lack_is_refused_by_name(server):
    results = stream(server, trtllm_inputs(["Hello"], 4, streaming=False,
                                           beam_width=np.full((1, 1), 2, dtype=np.int32)))
    (result, error), = results
    assert error is not None and "beam_width=2 is not supported" in error.message()


def test_plain_infer_over_http_on_the_unary_model(server):
    prompts = ["The capital of France is", "Hello"]
    result = http_infer(server, "ensemble_unary", {"text_input": np.array([[p] for p in prompts]).astype(object),
                                                   "max_tokens": np.full((2, 1), 5, dtype=np.int32),
                                                   "bad_words": np.array([[""], [""]]).astype(object),
                                                   "stop_words": np.array([[""], [""]]).astype(object)},
                        outputs=["text_output"])
    texts = [t.decode() for t in result.as_numpy("text_output")]
    assert len(texts) == 2 and all(texts)  # sampled at temperature 1: non-empty; the streaming test compares


def http_infer(server, model, values: dict, outputs=None):
    client = httpclient.InferenceServerClient(server.http_url)
    return client.infer(model, infer_inputs(values, httpclient),
                        outputs=[httpclient.InferRequestedOutput(n) for n in outputs or []] or None)


def test_the_inner_models_one_by_one_give_what_the_whole_pipeline_gives(server):
    """As TensorRT-LLM's end_to_end_test.py drives them: preprocessing, tensorrt_llm, postprocessing by hand,
    then the whole request; the two texts must be equal (greedy, the prompt leading both)."""
    prompt = np.array([["The capital of France is"]]).astype(object)
    length = np.array([[8]], dtype=np.int32)
    words = np.array([[""]]).astype(object)
    pre = http_infer(server, "trtllm_preprocessing", {"QUERY": prompt, "REQUEST_OUTPUT_LEN": length,
                                                      "BAD_WORDS_DICT": words, "STOP_WORDS_DICT": words})
    gen = http_infer(server, "tensorrt_llm", {
        "input_ids": pre.as_numpy("INPUT_ID"), "decoder_input_ids": pre.as_numpy("DECODER_INPUT_ID"),
        "input_lengths": pre.as_numpy("REQUEST_INPUT_LEN"), "request_output_len": pre.as_numpy("REQUEST_OUTPUT_LEN"),
        "end_id": pre.as_numpy("OUT_END_ID"), "pad_id": pre.as_numpy("OUT_PAD_ID")})
    ids, lengths = gen.as_numpy("output_ids"), gen.as_numpy("sequence_length")
    assert ids.shape[:2] == (1, 1) and lengths[0, 0] == pre.as_numpy("REQUEST_INPUT_LEN")[0, 0] + 8
    post = http_infer(server, "trtllm_postprocessing", {"TOKENS_BATCH": ids, "SEQUENCE_LENGTH": lengths})
    whole = http_infer(server, "ensemble_unary", {"text_input": prompt, "max_tokens": length, "bad_words": words,
                                                  "stop_words": words}, outputs=["text_output"])
    assert post.as_numpy("OUTPUT").reshape(-1)[0] == whole.as_numpy("text_output").reshape(-1)[0]
    assert post.as_numpy("OUTPUT").reshape(-1)[0].startswith(b"The capital of France is")
