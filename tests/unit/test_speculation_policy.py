"""The draft policy: a request drafts only while its expected accepted tokens are worth the verification rows, by
the engine's own step times per row count. Misses (verified or not) stop its drafts, hits bring them back, dearer
rows stop drafts that cheap rows allow, and the "always" policy keeps drafting (the tests about outputs use it)."""
from __future__ import annotations

from inflight.config import EngineConfig
from inflight.sequence import SamplingParams, Sequence
from inflight.speculation import NgramProposer, Speculator

ALPHABET = (1, 2, 3)


def speculator(policy: str = "cost", step_ms=lambda rows: 20.0 + 5.0 * (rows - 1)) -> Speculator:
    """A speculator over 1-gram lookup, its step costs recorded as the engine records them (a few steps each)."""
    spec = Speculator.from_config(EngineConfig(speculative_method="ngram", num_speculative_tokens=5,
                                               prompt_lookup_min=1, prompt_lookup_max=1,
                                               speculative_draft_policy=policy))
    for rows in range(1, 7):
        for _ in range(3):
            spec.record_step(rows, step_ms(rows) / 1000)
    return spec


def decoding_sequence() -> Sequence:
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1], SamplingParams(), 10_000)
    seq.token_ids.append(2)
    seq.num_computed_tokens = len(seq.token_ids) - 1
    return seq


def decode_step(spec: Speculator, seq: Sequence, hit: bool) -> int:
    """One engine step of `seq` as the engine runs it: propose, then the sampled token either is what prompt
    lookup guesses (hit) or is not (miss), with the drafts verified accordingly. Returns the drafts it had."""
    guess = NgramProposer(1, 1).propose(seq, 1)[0]  # what the speculator's own proposer guesses next
    spec.propose([seq])
    drafts, seq.spec_token_ids = seq.spec_token_ids, []
    if drafts:
        accepted = len(drafts) if hit else 0
        spec.observe(seq, len(drafts), accepted)
        seq.token_ids += drafts[:accepted]
    token = guess if hit and not drafts else next(t for t in ALPHABET if t != guess)
    seq.token_ids.append(token)
    seq.num_computed_tokens = len(seq.token_ids) - 1
    return len(drafts)


def test_misses_stop_a_requests_drafts_and_hits_bring_them_back():
    spec, seq = speculator(), decoding_sequence()
    misses = [decode_step(spec, seq, hit=False) for _ in range(30)]
    assert misses[0] > 0  # a new request is given the benefit of the doubt
    assert misses[-20:] == [0] * 20  # its guesses keep failing: no rows spent on them
    hits = [decode_step(spec, seq, hit=True) for _ in range(12)]
    assert hits[-1] >= 3  # guesses that would have held (seen without drafting) bring drafts back


def test_dearer_rows_stop_drafts_that_cheap_rows_allow():
    """The same request (half its guesses hold) drafts where a row costs 5% of a step, and not where it costs
    60% (the other core busy, a CPU where more rows are not nearly free)."""
    def half_hits(spec: Speculator) -> list[int]:
        seq = decoding_sequence()
        return [decode_step(spec, seq, hit=i % 2 == 0) for i in range(40)]

    cheap = half_hits(speculator(step_ms=lambda rows: 20.0 * (1 + 0.05 * (rows - 1))))
    dear = half_hits(speculator(step_ms=lambda rows: 20.0 * (1 + 0.6 * (rows - 1))))
    assert sum(d > 0 for d in cheap[-20:]) >= 8
    assert dear[-20:] == [0] * 20


def test_the_always_policy_drafts_whatever_it_costs():
    spec, seq = speculator("always", step_ms=lambda rows: 20.0 * rows), decoding_sequence()
    assert all(decode_step(spec, seq, hit=False) >= 1 for _ in range(20))


def test_an_unmeasured_row_count_is_tried_and_a_stale_one_measured_again():
    spec = Speculator.from_config(EngineConfig(speculative_method="ngram"))
    costs = spec.costs
    assert costs.estimate(3) is None  # nothing measured: the policy drafts (and so measures)
    spec.record_step(1, 0.020)
    spec.record_step(3, 0.050)
    assert costs.estimate(2) == 0.020  # unmeasured: as the nearest fewer rows, so it gets tried
    assert abs(costs.estimate(3) - 0.050) < 1e-12
    spec.record_step(3, 0.030)
    assert 0.030 < costs.estimate(3) < 0.050  # a running average, not the last step alone
    for _ in range(costs.stale_after_steps + 1):
        spec.record_step(1, 0.020)
    assert costs.estimate(3) == 0.020  # not measured for long: treated as unmeasured again


def test_the_engine_records_decode_steps_only():
    """Through the engine: decode-only steps (with or without drafts) are recorded by their row count; the
    prompt's prefill step is not."""
    from engine_helpers import TINY
    from inflight import LLM

    llm = LLM(TINY, speculative_method="ngram", max_num_seqs=4, num_kv_blocks=64)
    engine = llm.engine
    costs = engine.speculator.costs
    before = costs.num_recorded
    steps = 0
    engine.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_tokens=12, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert costs.num_recorded - before == steps - 1  # every step but the prefill
    assert costs.estimate(1) is not None
