"""Structured output's check-first path (grammar/bitmask.py): on CPU a constrained row samples from its unmasked
logits and its matcher checks the token; only a refused row is masked and chosen again. Greedy rows must choose
exactly what the whole mask chooses, sampled rows must follow the masked distribution, and rows that need the
whole mask (logprobs, min_tokens, top-p/top-k/min-p, an unforked n > 1) must still get it before sampling.

Most tests use xgrammar on a small vocabulary of our own (every token known, fast); the engine test runs the tiny
random Llama, whose noise the grammar refuses most of the time."""
from __future__ import annotations

import re
import string
import time

import numpy as np
import pytest
import torch

from engine_helpers import TINY, assert_pool_whole
from inflight import EngineConfig, SamplingParams
from inflight.engine import LLMEngine
from inflight.grammar import bitmask
from inflight.grammar.bitmask import StepMask
from inflight.sampler import Sampler
from inflight.sequence import Sequence

xgr = pytest.importorskip("xgrammar")

EOS = 0
# 0: end of sequence; single characters; then pairs of letters, so a grammar's allowed set is spread over words.
VOCAB = ["<eos>", *string.ascii_lowercase, *string.digits, '"', "{", "}", ":", ",", " ", "\\",
         *(a + b for a in "abcdefghij" for b in "abcdefghij")]
V = len(VOCAB)
NEG_INF = float("-inf")


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1)


def make_seqs(compiled, prefixes: list[str], **params) -> list[Sequence]:
    """One sequence per prefix, its matcher having accepted the prefix's characters (one token each)."""
    seqs = []
    for i, prefix in enumerate(prefixes):
        seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=64, **params), max_tokens=64)
        seq.grammar_matcher = xgr.GrammarMatcher(compiled)
        for ch in prefix:
            assert seq.grammar_matcher.accept_token(VOCAB.index(ch)), (prefix, ch)
        seqs.append(seq)
    return seqs


def check_first(logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler, mask: StepMask | None = None
                ) -> list[int]:
    """The engine's CPU step: mask what must be, sample, settle the checked rows. Returns the tokens."""
    mask = mask or StepMask(V, [EOS])
    checked = mask.apply(logits, seqs)
    out = sampler(logits, seqs, {EOS})
    tokens, logprobs = list(out.token_ids), list(out.logprobs)
    mask.settle(logits, seqs, checked, tokens, logprobs, sampler, {EOS})
    return tokens


def whole_mask(logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler) -> list[int]:
    StepMask(V, [EOS]).apply(logits, seqs, check_first=False)
    return sampler(logits, seqs, {EOS}).token_ids


def allowed_ids(matcher) -> set[int]:
    words = xgr.allocate_token_bitmask(1, V)
    matcher.fill_next_token_bitmask(words, 0)
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:V]
    return set(np.flatnonzero(bits).tolist())


# ---- which rows are checked ----------------------------------------------------------------------------

@pytest.mark.parametrize("params, is_checked", [
    ({"temperature": 0.0}, True),
    ({"temperature": 1.0}, True),
    ({"temperature": 0.7, "repetition_penalty": 1.3, "top_k": -1}, True),  # penalties commute with the mask
    ({"temperature": 0.0, "logprobs": 2}, False),  # logprobs of the masked distribution
    ({"temperature": 0.0, "logprobs": 0}, False),  # what cumulative_logprob asks for
    ({"temperature": 0.0, "min_tokens": 3}, False),  # reads the mask: may the grammar only end?
    ({"temperature": 1.0, "n": 2}, False),  # its samples fork from this row's logits
    ({"temperature": 1.0, "top_p": 0.9}, False),  # a cut of the masked distribution
    ({"temperature": 1.0, "top_k": 3}, False),
    ({"temperature": 1.0, "min_p": 0.1}, False),
])
def test_rows_that_need_the_whole_mask_get_it_before_sampling(compiler, params, is_checked):
    seqs = make_seqs(compiler.compile_regex("[abc]+"), [""], **params)
    logits = torch.zeros(1, V)
    checked = StepMask(V, [EOS]).apply(logits, seqs)
    assert checked == ([0] if is_checked else [])
    masked = set(torch.nonzero(logits[0] == NEG_INF).flatten().tolist())
    abc = {i for i, t in enumerate(VOCAB) if i != EOS and set(t) <= set("abc")}  # a, b, ab, ca, ...
    assert masked == (set() if is_checked else set(range(V)) - abc)


def test_nothing_is_checked_when_the_caller_says_so(compiler):
    """A step that verifies drafts (and CUDA, where the mask is applied while the forward runs)."""
    seqs = make_seqs(compiler.compile_regex("[abc]+"), [""], temperature=0.0)
    logits = torch.zeros(1, V)
    assert StepMask(V, [EOS]).apply(logits, seqs, check_first=False) == []
    assert int((logits[0] == NEG_INF).sum()) == V - 12  # a, b, c and the nine pairs of them


# ---- greedy: the same tokens ---------------------------------------------------------------------------

def test_masked_argmax_from_the_mask_row_equals_torch_over_the_masked_row():
    """Both ways _allowed_block reads a row (only the words holding allowed tokens, or all), ties, empty rows."""
    gen = np.random.default_rng(0)
    width = 1000
    words_per_row = (width + 31) // 32
    sides = set()
    for density in (0.0, 0.002, 0.05, 0.5, 0.95, 0.999, 1.0):
        for _ in range(30):
            allowed = gen.random(words_per_row * 32) < density
            words = np.packbits(allowed, bitorder="little").view(np.uint32)
            values = gen.integers(-3, 3, width).astype(np.float32)  # few values: many ties
            block = bitmask._allowed_block(values, words)
            got = None if block is None else bitmask._argmax(*block)
            row = torch.where(torch.from_numpy(allowed[:width]), torch.from_numpy(values), NEG_INF)
            want = None if not allowed[:width].any() else int(row.argmax())
            assert got == want, (density, got, want)
            sides.add(len(np.flatnonzero(words)) <= len(np.flatnonzero(words != 0xFFFFFFFF)))
    assert sides == {True, False}


@pytest.mark.parametrize("penalised", [False, True])
def test_greedy_rows_checked_first_choose_what_the_whole_mask_chooses(compiler, penalised):
    # A JSON-ish grammar: keys from a few letters, values quoted strings of anything but a quote or a backslash
    # (most of the vocabulary) or numbers: its allowed sets run from one token to nearly all of them.
    compiled = compiler.compile_grammar(r'''
        root ::= "{" pair ("," pair)* "}"
        pair ::= "\"" [a-c]+ "\":" (string | [0-9]+)
        string ::= "\"" [^"\\]* "\""
    ''')
    prefixes = ['', '{', '{"', '{"ab', '{"a":', '{"a":"', '{"a":"xyz', '{"a":12', '{"a":"q",', '{"a":"q","b":3']
    params = {"repetition_penalty": 1.5} if penalised else {}
    mask = StepMask(V, [EOS])
    for seed in range(40):
        seqs = make_seqs(compiled, prefixes, temperature=0.0, **params)
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randint(-4, 4, (len(prefixes), V), generator=gen).float()  # ties on purpose
        sampler = Sampler(seed=0)
        checked_before = mask.num_checked
        tokens = check_first(logits.clone(), seqs, sampler, mask=mask)
        assert mask.num_checked - checked_before == len(prefixes)  # every row checked, none masked first
        assert tokens == whole_mask(logits.clone(), seqs, sampler)
        for seq, token in zip(seqs, tokens):
            assert token in allowed_ids(seq.grammar_matcher)
    refused, accepted = mask.num_refused, mask.num_checked - mask.num_refused
    assert refused > 50 and accepted > 50, (refused, accepted)


def test_a_checked_row_leaves_its_matcher_where_it_was(compiler):
    """The engine accepts every token after the step: a check that kept its accept would advance the matcher
    twice."""
    compiled = compiler.compile_regex("(ab|cd){3}")
    seqs = make_seqs(compiled, ["ab", "abc"], temperature=0.0)
    logits = torch.zeros(2, V)
    logits[0, VOCAB.index("c")] = 5.0  # allowed: kept
    logits[1, VOCAB.index("a")] = 5.0  # refused: the masked argmax is d
    tokens = check_first(logits, seqs, Sampler(seed=0))
    assert tokens == [VOCAB.index("c"), VOCAB.index("d")]
    fresh = make_seqs(compiled, ["ab", "abc"])
    for seq, same in zip(seqs, fresh):
        assert allowed_ids(seq.grammar_matcher) == allowed_ids(same.grammar_matcher)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_choice_is_refused_still_gets_a_valid_token(compiler, temperature):
    compiled = compiler.compile_regex("[0-9]{2}")
    seqs = make_seqs(compiled, ["", "4"], temperature=temperature, seed=7)
    logits = torch.full((2, V), -2.0)
    logits[:, VOCAB.index("x")] = 30.0  # the model insists on a letter the grammar refuses
    mask = StepMask(V, [EOS])
    checked = mask.apply(logits, seqs)
    sampler = Sampler(seed=0)
    out = sampler(logits, seqs, {EOS})
    tokens, logprobs = list(out.token_ids), list(out.logprobs)
    assert tokens == [VOCAB.index("x")] * 2
    mask.settle(logits, seqs, checked, tokens, logprobs, sampler, {EOS})
    assert mask.num_refused == 2
    digits = {VOCAB.index(d) for d in string.digits}
    assert all(t in digits for t in tokens), tokens
    for seq, token in zip(seqs, tokens):
        assert seq.grammar_matcher.accept_token(token)


# ---- sampled: the masked distribution ------------------------------------------------------------------

def draw(compiler, params: dict, same_numbers: bool = False, n: int = 20000) -> tuple[np.ndarray, float]:
    """n seeded draws of one step under the regex [abc] with most of the unmasked mass on refused d and e.
    Returns the frequencies of a, b, c and the share of rows refused. same_numbers: a refused row draws again
    with its first draw's number (what the sampler's redraw stream is there to avoid)."""
    seqs = make_seqs(compiler.compile_regex("[abc]"), [""] * n, temperature=1.0, **params)
    for i, seq in enumerate(seqs):
        seq.params.seed = i
    logits = torch.full((n, V), NEG_INF)
    for ch, value in {"a": 2.0, "b": 1.0, "c": 0.0, "d": 2.5, "e": 1.5}.items():
        logits[:, VOCAB.index(ch)] = value
    sampler = Sampler(seed=0)
    if same_numbers:
        sampler.uniform = lambda seq, redraw=False: Sampler.uniform(sampler, seq)
    mask = StepMask(V, [EOS])
    assert len(mask.apply(logits, seqs)) == n
    tokens = check_first(logits, seqs, sampler, mask)
    counts = np.bincount(tokens, minlength=V)
    assert counts.sum() == counts[[1, 2, 3]].sum(), "a token outside [abc]"
    return counts[[1, 2, 3]] / n, mask.num_refused / n


# Plain rows choose among their allowed logits read through the mask; a penalised row (presence: no output yet,
# so no change to its logits) is masked whole and drawn again by the sampler.
DRAWS = [{}, {"presence_penalty": 0.5}]


@pytest.mark.parametrize("params", DRAWS)
def test_sampled_rows_checked_first_follow_the_masked_distribution(compiler, params):
    masked = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0).numpy()  # a, b, c: 0.665, 0.245, 0.090
    freqs, refused = draw(compiler, params)
    # Unmasked, d and e hold 60% of the mass: most rows take the second draw.
    assert refused == pytest.approx(0.60, abs=0.02)
    # 20000 draws: a frequency's standard error is at most 0.0035; 0.015 is over four of them.
    assert freqs == pytest.approx(masked, abs=0.015), (freqs, masked)


@pytest.mark.parametrize("params", DRAWS)
def test_a_second_draw_with_the_first_draws_number_would_not_be_the_masked_distribution(compiler, params):
    """Why the redraw has numbers of its own: drawing again with the first number, the refused rows land on the
    masked tokens in proportion to where the refused mass lay (a: 0.53 instead of 0.665). So the test above
    can tell a wrong second draw from a right one."""
    masked = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0).numpy()
    freqs, _ = draw(compiler, params, same_numbers=True)
    assert abs(freqs[0] - masked[0]) > 0.1, freqs


# ---- the engine ----------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"type": "string", "enum": ["a", "b"]},
                                           "note": {"type": "string", "maxLength": 12}},
          "required": ["id", "kind", "note"]}


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, str]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    texts = dict.fromkeys(requests, "")
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        if engine.waits_only_for_grammars():
            time.sleep(0.005)
        for o in engine.step():
            texts[o.request_id] += o.text_delta
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
    return texts


def test_engine_greedy_outputs_are_those_of_the_whole_mask(monkeypatch):
    engine = LLMEngine(EngineConfig(model=TINY, num_kv_blocks=96, max_model_len=256, max_num_seqs=16))

    def requests(tag: str) -> dict:
        tight = {"disable_any_whitespace": True}
        return {f"{tag}json{i}": (f"Record {i}:", SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={
                    "json": SCHEMA, **tight})) for i in range(4)} | {
                f"{tag}date": ("Hello", SamplingParams(max_tokens=20, temperature=0.0,
                                                       structured_outputs={"regex": r"\d{4}-\d{2}-\d{2}"})),
                f"{tag}pen": ("Hello", SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3,
                                                      structured_outputs={"regex": "[a-z]{3,9}!"})),
                f"{tag}free": ("Hello", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))}

    mask = engine.step_mask
    checked0, refused0 = mask.num_checked, mask.num_refused
    first = run(engine, requests("a"))
    checked, refused = mask.num_checked - checked0, mask.num_refused - refused0
    assert refused > 20 and checked > refused, (checked, refused)  # the noise is mostly refused, not always
    real_apply = StepMask.apply
    monkeypatch.setattr(StepMask, "apply", lambda self, logits, seqs, check_first=True:
                        real_apply(self, logits, seqs, check_first=False))
    second = run(engine, requests("b"))
    assert mask.num_checked - checked0 == checked  # nothing checked: the whole mask each step
    assert {k[1:]: v for k, v in first.items()} == {k[1:]: v for k, v in second.items()}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", first["adate"]), first["adate"]
    engine.grammars.close()
