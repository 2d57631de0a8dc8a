"""The outputs the peers' clients read, on the real tiny engine through the frontend (as tests/unit/test_frontend.py
does): vLLM's logprobs layout, cumulative_logprob on every response, TensorRT-LLM's cum_log_probs and
output_log_probs, end_id, and the chat template. Written from the peers' documented behaviour."""
import json
import math

import pytest

from engine_helpers import TINY, assert_pool_whole
from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from inflight.prompt import PromptEncoder
from serving.frontend import InflightFrontend
from test_frontend import RecordingTransport, Sender, request, text_of, wait


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=64, max_model_len=256))


@pytest.fixture
def frontend(engine):
    transport = RecordingTransport()
    fe = InflightFrontend(engine, transport, cancel_check_period_s=0.02)
    fe.start()
    yield fe
    fe.close()
    assert transport.violations == []
    assert_pool_whole(engine)


def run(frontend, prompt="In this example,", **fields):
    sender = Sender("s")
    frontend.submit(sender, "r", request(prompt, **fields))
    wait(sender)
    assert all(e is None for _, _, e in sender.events), [e.message for _, _, e in sender.events if e]
    return sender


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_logprobs_layout(frontend, stream):
    s = run(frontend, max_tokens=8, ignore_eos=True, temperature=0.0, stream=stream, return_logprobs=True,
            return_num_output_tokens=True, sampling_parameters=json.dumps({"logprobs": 2}))
    rank_one_text = ""
    for outputs, _, _ in s.events:
        tokens = json.loads(outputs["logprobs"][0])
        assert len(tokens) == int(outputs["num_output_tokens"][0]) >= 1
        for entry in tokens:
            assert 1 <= len(entry) <= 3  # the sampled token and the top 2 (it may be one of them)
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[0] == 1 and len(set(ranks)) == len(ranks)
            for token_id, v in entry.items():
                assert token_id.isdigit() and isinstance(v["logprob"], float) and v["logprob"] <= 0.0
                assert isinstance(v["decoded_token"], str)
            rank_one_text += next(v["decoded_token"] for v in entry.values() if v["rank"] == 1)
    assert rank_one_text == text_of(s)  # greedy: the sampled token is the most likely one


def test_logprobs_output_is_null_when_the_request_set_no_logprobs(frontend):
    s = run(frontend, max_tokens=3, ignore_eos=True, stream=True, return_logprobs=True)
    assert all(o["logprobs"][0] == b"null" for o, _, _ in s.events)


def test_cumulative_logprob_on_every_response(frontend):
    s = run(frontend, max_tokens=6, ignore_eos=True, stream=True, return_cumulative_logprob=True)
    values = [float(o["cumulative_logprob"][0]) for o, _, _ in s.events]
    assert len(values) > 1 and all(b < a for a, b in zip(values, values[1:]))  # each token adds a negative logprob
    assert all("logprobs" not in o for o, _, _ in s.events)


def test_tensorrt_llm_log_probs(frontend):
    s = run(frontend, max_tokens=5, ignore_eos=True, temperature=0.7, seed=3, return_log_probs=True)
    (outputs, _, _), = s.events
    per_token = outputs["output_log_probs"]
    assert per_token.shape == (1, 5) and (per_token <= 0).all()  # [samples, tokens]
    assert math.isclose(float(outputs["cum_log_probs"][0]), float(per_token.sum()), rel_tol=1e-4)


def test_end_id_ends_the_output_like_eos(frontend):
    whole = run(frontend, max_tokens=8, ignore_eos=False, temperature=0.0, return_logprobs=True,
                sampling_parameters=json.dumps({"logprobs": 0}))
    first_ids = [int(next(iter(entry))) for entry in json.loads(whole.events[0][0]["logprobs"][0])]
    third = first_ids[2]
    if third in first_ids[:2]:
        pytest.skip("the tiny model repeats a token within its first three")
    s = run(frontend, max_tokens=8, temperature=0.0, end_id=third, return_finish_reason=True,
            return_num_output_tokens=True)
    (outputs, _, _), = s.events
    assert outputs["finish_reason"][0] == b"stop" and int(outputs["num_output_tokens"][0]) == 3


def test_chat_template_is_applied_on_request(frontend):
    raw = run(frontend, max_tokens=2, ignore_eos=True, return_num_input_tokens=True)
    chat = run(frontend, max_tokens=2, ignore_eos=True, return_num_input_tokens=True, apply_chat_template=True)
    assert int(chat.events[0][0]["num_input_tokens"][0]) > int(raw.events[0][0]["num_input_tokens"][0]) + 10


def test_a_model_without_a_chat_template_refuses_it_by_name(engine):
    class NoTemplate:
        chat_template = None

        def __len__(self):
            return 1

        def decode(self, ids):
            return "x"

    with pytest.raises(InvalidRequestError, match="apply_chat_template=True is not allowed"):
        PromptEncoder(NoTemplate(), 16, 1024).encode("Hi", chat=True)


def test_n_samples_come_back_as_one_element_each(frontend):
    common = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11, return_finish_reason=True,
                  return_num_output_tokens=True, sampling_parameters=json.dumps({"n": 3}))
    streamed = run(frontend, stream=True, **common)
    whole = run(frontend, **common)
    (outputs, _, _), = whole.events
    assert outputs["text_output"].shape == (3,) and outputs["num_output_tokens"].tolist() == [6, 6, 6]
    assert outputs["finish_reason"].tolist() == [b"length"] * 3
    texts = ["", "", ""]
    for o, _, _ in streamed.events:
        assert o["text_output"].shape == (3,)
        for i, t in enumerate(o["text_output"]):
            texts[i] += t.decode()
    assert texts == [t.decode() for t in outputs["text_output"]] and len(set(texts)) == 3
