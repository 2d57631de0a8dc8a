"""Prompt checks in the engine (inflight.prompt, shared with the dynamic arm's preprocessing): an empty prompt
is refused; text that cannot fit max_model_len, or is over max_prompt_bytes, is refused before the tokenizer
sees it (a 1 MiB prompt costs seconds of tokenizing on the request thread); text that might fit is tokenized
and then held to max_model_len."""
import pytest

from engine_helpers import TINY
from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from inflight.fields import InvalidRequestError
from inflight.sequence import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY, num_kv_blocks=16, max_model_len=64))


def test_the_cap_follows_max_model_len_and_the_longest_token(engine):
    longest = max(len(engine.tokenizer.decode([i]).encode()) for i in (0, 1, 100, 46778))
    prompts = engine.prompts
    assert prompts.max_token_bytes >= longest > 1
    assert prompts.max_prompt_bytes == min(1 << 20, 2 * 64 * prompts.max_token_bytes)


def test_too_long_text_is_refused_without_tokenizing(engine, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(engine.tokenizer, "encode", boom)
    cap = engine.prompts.max_prompt_bytes
    for prompt in ("a" * (cap + 1), "你" * (cap // 3 + 1)):
        with pytest.raises(InvalidRequestError) as info:
            engine.make_sequence("r", prompt, SamplingParams(max_tokens=1))
        message = str(info.value)
        assert f"text_input=<{len(prompt.encode())} bytes> is out of range" in message
        assert f"allowed at most {cap} bytes" in message and "max_model_len=64" in message


def test_text_under_the_byte_cap_is_still_held_to_max_model_len(engine):
    with pytest.raises(InvalidRequestError, match="max_model_len=64"):
        engine.make_sequence("r", "word " * 100, SamplingParams(max_tokens=1))
    seq = engine.make_sequence("r", "Hello there", SamplingParams(max_tokens=4))
    assert seq.num_prompt_tokens > 0


def test_the_configured_cap_wins_when_smaller():
    engine = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=16, max_model_len=64, max_prompt_bytes=10))
    assert engine.make_sequence("r", "x" * 10, SamplingParams(max_tokens=1)).num_prompt_tokens > 0
    with pytest.raises(InvalidRequestError) as info:
        engine.make_sequence("r", "你好世界", SamplingParams(max_tokens=1))
    message = str(info.value)  # bytes, not characters: 4 Chinese characters are 12 bytes
    assert "text_input=<12 bytes> is out of range" in message and "at most 10 bytes" in message
    assert "max_prompt_bytes=10" in message


def test_an_empty_prompt_is_refused_by_name(engine):
    with pytest.raises(InvalidRequestError, match="text_input='' is empty: allowed a non-empty prompt"):
        engine.make_sequence("r", "", SamplingParams(max_tokens=1))
