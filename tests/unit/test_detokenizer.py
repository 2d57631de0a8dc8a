"""Incremental detokenizer: streamed deltas equal the full decode byte for byte; stop strings never leak."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight.detokenizer import IncrementalDetokenizer
from inflight.sequence import SamplingParams, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIRS = [os.path.join(ROOT, "models", name) for name in ("SmolLM2-135M-Instruct", "tiny-llama")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _offline_byte_level_bpe():
    """A GPT2-style byte-level BPE trained here, for checkouts without the prepared model folders."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog.", "你好，世界！今天天气很好。", "emoji 🙂🎉👍🏽 ok",
              "multiple   spaces\n\nand\tnewlines", "Hello world, hello tokens."] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIALS)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    for path in TOKENIZER_DIRS:
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            return AutoTokenizer.from_pretrained(path)
    return _offline_byte_level_bpe()


def make_seq(prompt_ids=(1, 2, 3), **params) -> Sequence:
    return Sequence("r", list(prompt_ids), SamplingParams(**params), max_tokens=10_000)


def stream(tokenizer, output_ids: list[int], finish: bool = True, **params) -> tuple[list[str], Sequence, bool]:
    """Drive the detokenizer as the engine does; returns (deltas, seq, stopped_by_string)."""
    detok = IncrementalDetokenizer(tokenizer)
    prompt = tokenizer.encode("Prompt: say something.")
    seq = make_seq(prompt, **params)
    deltas: list[str] = []
    for tok in output_ids:
        seq.append_token(tok)
        prev = len(seq.output_text)
        detok.update(seq)
        if seq.params.stop and detok.find_stop(seq, prev):
            deltas.append(detok.take_delta(seq, finished=True))
            return deltas, seq, True
        deltas.append(detok.take_delta(seq, finished=False))
    if finish:
        prev = len(seq.output_text)
        detok.finalize(seq)
        deltas.append(detok.take_delta(seq, finished=True))
    return deltas, seq, False


TEXTS = [
    "Hello, world! This is a plain sentence.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "Emoji: 🙂🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵.",
    "multiple     spaces   here\n\n\nand newlines\r\n\tand tabs  \n",
    "mixed 中文 and English 🚀 with   gaps\n結束",
    "   leading spaces and trailing   ",
    "naïve café résumé — “quotes” ‘single’ …",
]


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, seq, _ = stream(tokenizer, ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    assert seq.output_text == full
    assert full == text  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("text", TEXTS)
def test_no_delta_ever_carries_a_partial_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_span_tokens(tokenizer):
    # Sanity check of the fixture: the hard case (one character over several tokens) really occurs.
    ids = tokenizer.encode("👨‍👩‍👧‍👦🇫🇷", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def test_partial_character_is_held_then_completed(tokenizer):
    ids = tokenizer.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    seq = make_seq()
    emitted = []
    for t in ids:
        seq.append_token(t)
        detok.update(seq)
        emitted.append(seq.output_text)
    assert all("\ufffd" not in e for e in emitted)
    assert emitted[-1] == "a😀"
    if len(ids) > 2:  # the emoji is split: nothing of it shows before its last byte arrives
        assert emitted[-2] == "a"


def ids_ending_mid_character(tokenizer, text: str) -> list[int]:
    """The longest token prefix of text whose decode ends inside a multi-byte character."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for i in range(len(ids) - 1, 0, -1):
        if tokenizer.decode(ids[:i]).endswith("\ufffd"):
            return ids[:i]
    raise AssertionError(f"{text!r} has no token boundary inside a character: pick another text")


def test_trailing_undecodable_bytes_appear_only_at_finalize(tokenizer):
    partial = ids_ending_mid_character(tokenizer, "ok 😀")
    deltas, seq, _ = stream(tokenizer, partial, finish=False)
    assert "\ufffd" not in "".join(deltas)
    detok = IncrementalDetokenizer(tokenizer)
    detok.finalize(seq)
    final = detok.take_delta(seq, finished=True)
    assert final.endswith("\ufffd")
    assert "".join(deltas) + final == tokenizer.decode(partial)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = (tokenizer.encode("Hi there", add_special_tokens=False)
           + tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
           + tokenizer.encode(" 你好 🙂", add_special_tokens=False)
           + tokenizer.convert_tokens_to_ids(["<|endoftext|>"]))
    deltas, seq, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    assert ("<|im_end|>" in full) is (not skip)


def test_decode_window_stays_small(tokenizer):
    # O(1) per token: the detokenizer never decodes more than a handful of tokens at once.
    lengths = []

    class Spy:
        def decode(self, ids, **kw):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kw)

    text = ("A long answer with 中文字符 and emoji 🙂 repeated.  " * 40).strip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(Spy())
    seq = make_seq()
    for t in ids:
        seq.append_token(t)
        detok.update(seq)
    assert len(ids) > 300
    assert max(lengths) <= 8
    assert seq.output_text == text
    assert seq.detok_read_offset == len(ids)


# ---- stop strings ---------------------------------------------------------------------------------

def split_stop_case(tokenizer, text: str, stop: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([t]) for t in ids]
    # Assert the case is the interesting one: no single token holds the whole stop string.
    assert not any(stop in p for p in pieces)
    return ids


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is 42. END of story and more text", "END of", "The answer is 42. "),
    ("Say hello world and then goodbye", "lo wor", "Say hel"),
    ("第一段。\n\n第二段开始了", "\n\n第二", "第一段。"),
    ("emoji 🙂🎉 then stop", "🎉 th", "emoji 🙂"),
    ("spaces    inside   STOP", "   ST", "spaces    inside"),
])
def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer, text, stop, expected):
    ids = split_stop_case(tokenizer, text, stop)
    deltas, seq, stopped = stream(tokenizer, ids, stop=[stop])
    assert stopped
    streamed = "".join(deltas)
    assert streamed == expected
    assert seq.output_text == expected
    # At no point did the client hold any part of the stop string beyond the cut.
    running = ""
    for d in deltas:
        running += d
        assert len(running) <= len(expected) and expected.startswith(running)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    deltas, seq, stopped = stream(tokenizer, ids, stop=["gamma", "a beta", "delta"])
    assert stopped and "".join(deltas) == "alph"


def test_no_stop_match_streams_everything(tokenizer):
    text = "nothing to see here, folks"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, stopped = stream(tokenizer, ids, stop=["xyz", "folkz"])
    assert not stopped and "".join(deltas) == text


def test_hold_back_is_longest_stop_minus_one(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    seq = make_seq(stop=["ab", "abcdef"])
    seq.output_text = "0123456789"
    assert detok.take_delta(seq, finished=False) == "01234"  # 10 - (6 - 1)
    assert seq.num_text_sent == 5
    assert detok.take_delta(seq, finished=False) == ""
    assert detok.take_delta(seq, finished=True) == "56789"
    assert detok.take_delta(seq, finished=True) == ""


def test_no_hold_back_without_stop_strings(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    seq = make_seq()
    seq.output_text = "abc"
    assert detok.take_delta(seq, finished=False) == "abc"


def test_find_stop_searches_only_where_a_new_match_can_start(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    seq = make_seq(stop=["xx"])
    # An "xx" entirely inside text already checked is not looked at again (it could not have been missed).
    seq.output_text = "aaxxbbbb" + "cx"
    assert not detok.find_stop(seq, prev_text_len=8)
    seq.output_text += "x"
    assert detok.find_stop(seq, prev_text_len=10)  # "xx" straddles the old end
    assert seq.output_text == "aaxxbbbbc"


def test_find_stop_without_new_text_is_false(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    seq = make_seq(stop=["a"])
    seq.output_text = "bbb"
    assert not detok.find_stop(seq, prev_text_len=3)


def test_stop_string_revealed_by_finalize_is_still_cut(tokenizer):
    # The held-back tail (here a partial character) only shows up at finalize; a stop string in it is cut.
    partial = ids_ending_mid_character(tokenizer, "see 龘")
    deltas, seq, stopped = stream(tokenizer, partial, stop=["\ufffd"])
    assert not stopped
    assert "".join(deltas) == "see "


# ---- property: concatenation invariant on random text and random tokens ----------------------------

ALPHABET = st.sampled_from(list("abcXYZ019 .,!?\n\t") + ["  ", "   ", "\n\n"] + list("中文字符你好世界")
                           + ["🙂", "🎉", "👍🏽", "👨‍👩‍👧", "🇯🇵", "é", "ß", "—", "’"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ALPHABET, max_size=40).map("".join))
def test_property_streamed_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, seq, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_property_random_token_ids_including_invalid_utf8(tokenizer, data):
    # A model may emit any ids, including byte tokens that never form a character.
    ids = data.draw(st.lists(st.integers(0, len(tokenizer) - 1), max_size=30))
    skip = data.draw(st.booleans())
    deltas, _, _ = stream(tokenizer, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ALPHABET, min_size=1, max_size=40).map("".join),
       st.lists(st.sampled_from(["a", " b", "中", "🙂", "\n\n", "c d", "  ", "X1", "文字"]), min_size=1, max_size=3))
def test_property_stop_strings_cut_at_first_occurrence(tokenizer, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, seq, stopped = stream(tokenizer, ids, stop=stops)
    full = tokenizer.decode(ids)
    hits = [full.find(s) for s in stops if s in full]
    expected = full[:min(hits)] if hits else full
    streamed = "".join(deltas)
    assert streamed == expected
    assert stopped == bool(hits)
    assert not any(s in streamed for s in stops)


# ---- the streaming decoder (tokenizers' DecodeStream) against the window code ---------------------------

def _deltas(detok: IncrementalDetokenizer, ids: list[int], skip: bool) -> list[str]:
    seq = make_seq(skip_special_tokens=skip)
    out = []
    for t in ids:
        seq.append_token(t)
        prev = len(seq.output_text)
        detok.update(seq)
        out.append(seq.output_text[prev:])
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_property_stream_and_window_render_every_token_alike(tokenizer, data):
    # Token for token, not only in the end: random ids, byte tokens that split or never form characters,
    # special tokens skipped or not.
    pool = st.one_of(st.integers(0, len(tokenizer) - 1), st.integers(0, 300),
                     st.sampled_from(tokenizer.all_special_ids))
    ids = data.draw(st.lists(pool, max_size=30))
    skip = data.draw(st.booleans())
    streamed = IncrementalDetokenizer(tokenizer)
    assert streamed._backend is not None, "the fixture's tokenizer should take the streaming path"
    assert _deltas(streamed, ids, skip) == _deltas(IncrementalDetokenizer(tokenizer, stream=False), ids, skip)


def test_a_failing_stream_hands_over_to_the_window_code(tokenizer, monkeypatch):
    text = "Héllo 中文 wörld 🙂 and more text after it."
    ids = tokenizer.encode(text, add_special_tokens=False)
    calls = []

    class FlakyStream:  # works for a few tokens, holding one back, then raises
        def __init__(self, skip_special_tokens):
            from tokenizers.decoders import DecodeStream
            self.real = DecodeStream(skip_special_tokens=skip_special_tokens)

        def step(self, backend, token):
            calls.append(token)
            if len(calls) == 6:
                raise RuntimeError("invalid prefix")
            return self.real.step(backend, token)

    monkeypatch.setattr("inflight.detokenizer.DecodeStream", FlakyStream)
    deltas, seq, _ = stream(tokenizer, ids)
    assert len(calls) == 6 and seq.detok_stream is False
    assert "".join(deltas) == text
