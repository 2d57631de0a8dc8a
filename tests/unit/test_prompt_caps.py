"""Prompt size caps in the engine: text that cannot fit max_model_len is refused before the tokenizer sees it
(a 1 MiB prompt costs seconds of tokenizing on the request thread); text that might fit is tokenized and
then held to max_model_len."""
import pytest

from engine_helpers import TINY
from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from inflight.sequence import InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=16, max_model_len=64))


def test_the_cap_follows_max_model_len_and_the_longest_token(engine):
    longest = max(len(engine.tokenizer.decode([i]).encode()) for i in (0, 1, 100, 46778))
    assert engine.max_token_bytes >= longest > 1
    assert engine.max_prompt_bytes == 2 * 64 * engine.max_token_bytes


def test_too_long_text_is_refused_without_tokenizing(engine, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine.tokenizer, "encode", boom)
    for prompt in ("a" * (engine.max_prompt_bytes + 1), "你" * (engine.max_prompt_bytes // 3 + 1)):
        with pytest.raises(InvalidRequestError) as info:
            engine.make_sequence("r", prompt, SamplingParams(max_tokens=1))
        message = str(info.value)
        assert f"text_input=<{len(prompt.encode())} bytes> is out of range" in message
        assert f"allowed at most {engine.max_prompt_bytes} bytes" in message and "max_model_len=64" in message


def test_text_under_the_byte_cap_is_still_held_to_max_model_len(engine):
    with pytest.raises(InvalidRequestError, match="max_model_len=64"):
        engine.make_sequence("r", "word " * 100, SamplingParams(max_tokens=1))
    seq = engine.make_sequence("r", "Hello there", SamplingParams(max_tokens=4))
    assert seq.num_prompt_tokens > 0
