"""The tuner's trace format (tuner.trace): bad lines refused with their line number, mixes written and
read back unchanged, synthetic prompts of the asked length that read the same every time."""
from __future__ import annotations

import json
import statistics

import pytest
from transformers import AutoTokenizer

from engine_helpers import TINY
from tuner import trace as traces

GOOD = {"arrival_s": 0.5, "prompt": "Hello there", "output_tokens": 5}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TINY)


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ("[1, 2]", "list is not allowed"),
    (json.dumps({**GOOD, "arrival": 1}), "unknown key(s) arrival"),
    (json.dumps({**GOOD, "arrival_s": -1}), "arrival_s=-1 is out of range"),
    (json.dumps({**GOOD, "arrival_s": 0.1}), "arrival_s=0.1 is out of range: allowed >= the previous line's 0.5"),
    (json.dumps({**GOOD, "arrival_s": "1"}), "arrival_s='1' is out of range"),
    (json.dumps({**GOOD, "prompt_tokens": 5}), "exactly one of prompt"),
    (json.dumps({"arrival_s": 1, "output_tokens": 5}), "exactly one of prompt"),
    (json.dumps({**GOOD, "prompt": ""}), "prompt='' is not allowed"),
    (json.dumps({"arrival_s": 1, "prompt_tokens": 0, "output_tokens": 5}), "prompt_tokens=0 is out of range"),
    (json.dumps({**GOOD, "output_tokens": 0}), "output_tokens=0 is out of range"),
    (json.dumps({**GOOD, "output_tokens": 2.5}), "output_tokens=2.5 is out of range"),
    (json.dumps({**GOOD, "priority": True}), "priority=True is out of range"),
])
def test_a_bad_line_is_refused_with_its_line_number(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n" + json.dumps({**GOOD, "arrival_s": 9}) + "\n")
    with pytest.raises(traces.TraceError) as err:
        traces.load(path)
    assert str(err.value).startswith(f"{path}:3: "), str(err.value)  # the blank line 2 still counts
    assert message in str(err.value)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(traces.TraceError, match="no requests"):
        traces.load(path)


@pytest.mark.parametrize("mix", sorted(traces.MIXES))
def test_a_mix_round_trips_and_has_its_rate(tmp_path, tok, mix):
    reqs = traces.make_mix(mix, rate=4.0, num_requests=200, tokenizer=tok, scale=0.5, seed=3)
    path = tmp_path / f"{mix}.jsonl"
    traces.write(path, reqs)
    back = traces.load(path)
    assert [r.to_json() for r in back] == [r.to_json() for r in reqs]
    assert 3.0 < traces.offered_rate(back) < 5.3
    texts = [traces.prompt_text(r, tok) for r in back]
    assert texts == [traces.prompt_text(r, tok) for r in traces.load(path)]  # synthetic text is stable
    if mix == "chat":  # three shared system prompts: many prompts start alike
        assert len({t[:200] for t in texts}) == 3


def test_the_seed_mix_has_the_four_output_lengths_in_equal_shares(tok):
    reqs = traces.make_mix("seed", rate=1.0, num_requests=400, tokenizer=tok, scale=1.0)
    counts = {n: sum(r.output_tokens == n for r in reqs) for n in (20, 50, 200, 800)}
    assert counts == {20: 100, 50: 100, 200: 100, 800: 100}
    assert {r.prompt_tokens for r in reqs} == {32}


def test_synthetic_prompts_have_about_the_asked_length(tok):
    for n in (1, 7, 32, 300):
        ids = tok.encode(traces.synthetic_text(tok, n, seed=n))
        assert abs(len(ids) - n) <= 1


def test_bursty_arrivals_bunch_more_than_poisson(tok):
    def cv(b):
        reqs = traces.make_mix("seed", rate=2.0, num_requests=2000, tokenizer=tok, burstiness=b)
        gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert 0.9 < cv(1.0) < 1.1  # Poisson: exponential gaps
    assert cv(0.25) > 1.7  # gamma shape 1/4: CV 2


def test_a_prompt_log_becomes_a_trace(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"prompt": "a", "output_tokens": 3}) + "\n" + json.dumps({"text": "b"}) + "\n")
    reqs = traces.from_log(log, rate=2.0, output_tokens=9)
    assert [(r.prompt, r.output_tokens) for r in reqs] == [("a", 3), ("b", 9)]
    plain = tmp_path / "log.txt"
    plain.write_text("first prompt\nsecond prompt\n")
    assert [r.prompt for r in traces.from_log(plain, rate=1.0, output_tokens=4)] == ["first prompt",
                                                                                        "second prompt"]
