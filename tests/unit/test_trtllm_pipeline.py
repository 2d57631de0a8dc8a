"""TensorRT-LLM's inner-model interfaces (serving.trtllm_pipeline) with the real tokenizer, without Triton."""
import numpy as np
import pytest
from transformers import AutoTokenizer

from engine_helpers import TINY
from serving.trtllm_pipeline import generation_outputs, postprocess, preprocess, word_list


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


def test_preprocessing_pads_the_batch_and_reports_lengths(tokenizer):
    out = preprocess(tokenizer, {"QUERY": np.array([["Hello world"], ["Hi"]]).astype(object),
                                 "REQUEST_OUTPUT_LEN": np.array([[5], [7]], dtype=np.int32)})
    lengths = out["REQUEST_INPUT_LEN"].reshape(-1).tolist()
    assert lengths == [len(tokenizer.encode("Hello world")), len(tokenizer.encode("Hi"))]
    assert out["INPUT_ID"].shape == (2, max(lengths))
    assert out["INPUT_ID"][1, :lengths[1]].tolist() == tokenizer.encode("Hi")
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[5], [7]]
    assert out["OUT_END_ID"].reshape(-1).tolist() == [tokenizer.eos_token_id] * 2


def test_word_lists_use_tensorrt_llms_ids_and_offsets(tokenizer):
    words = word_list(tokenizer, [["Hello", "world"], [""]])
    hello, world = tokenizer.encode("Hello"), tokenizer.encode("world")
    assert words.shape[:2] == (2, 2)
    assert words[0, 0, :len(hello) + len(world)].tolist() == hello + world
    assert words[0, 1, :2].tolist() == [len(hello), len(hello) + len(world)]
    assert (words[1, 1] == -1).all()  # "" is no word


def test_generation_outputs_put_the_prompt_first_and_postprocessing_decodes_to_length(tokenizer):
    prompt, output = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris.")
    out = generation_outputs([prompt], [output], [[-0.5] * len(output)], pad_id=0)
    assert out["output_ids"].shape == (1, 1, len(prompt) + len(output))
    assert out["sequence_length"].tolist() == [[len(prompt) + len(output)]]
    assert out["cum_log_probs"][0, 0] == pytest.approx(-0.5 * len(output))
    text = postprocess(tokenizer, out["output_ids"], out["sequence_length"])
    assert text.tolist() == [[b"The capital of France is Paris."]]
