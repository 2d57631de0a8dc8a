"""Sampler: greedy fast path, penalties, bans, truncation, distribution, seeds and logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.sampler import Sampler, SamplerOutput, seeded_uniform
from inflight.sequence import SamplingParams, Sequence

V = 16
EOS = {15}


def make_seq(prompt=(1, 2), output=(), bad_word_ids=(), rid="r", **params) -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(**params), max_tokens=64)
    for t in output:
        seq.append_token(t)
    seq.bad_word_ids = [list(w) for w in bad_word_ids]
    return seq


def logits_of(*rows) -> torch.Tensor:
    out = torch.full((len(rows), V), -5.0)
    for i, row in enumerate(rows):
        for tok, val in row.items():
            out[i, tok] = val
    return out


def test_greedy_fast_path_is_argmax_with_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(5, V)
    before = logits.clone()
    seqs = [make_seq(temperature=0.0, rid=str(i)) for i in range(5)]
    out = Sampler(seed=0)(logits, seqs, EOS)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [0.0] * 5  # nobody asked: the vocabulary-wide logsumexp is skipped
    seqs[2].params.logprobs = True
    out = Sampler(seed=0)(logits, seqs, EOS)
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1)[:, None]).squeeze(1)
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)
    assert torch.equal(logits, before), "sampler must not modify the caller's logits"


def test_fast_path_builds_no_index_tensors(monkeypatch):
    # The hot path: all greedy, nothing to process. torch.tensor is how every slow path builds its
    # per-row parameters, so it must not be called here.
    calls = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = torch.randn(8, V)
    seqs = [make_seq(temperature=0.0, min_tokens=1, output=[3], rid=str(i)) for i in range(8)]  # min reached
    Sampler(seed=0)(logits, seqs, EOS)
    assert calls == []


def test_shape_mismatch_names_the_shape():
    with pytest.raises(ValueError, match=r"\(3, 16\).*2 sequences"):
        Sampler()(torch.zeros(3, V), [make_seq(), make_seq()], EOS)


def test_non_float32_logits_are_accepted():
    logits = logits_of({4: 3.0}).to(torch.bfloat16)
    assert Sampler()(logits, [make_seq(temperature=0.0)], EOS).token_ids == [4]


# ---- penalties --------------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    logits = logits_of({0: 2.0, 1: -1.0, 2: 1.5, 3: -1.5})
    seq = make_seq(prompt=[0], output=[1], temperature=0.0, repetition_penalty=2.0)
    processed = Sampler().process(logits, [seq], EOS)
    assert processed[0, 0].item() == pytest.approx(1.0)  # prompt token, positive: divided
    assert processed[0, 1].item() == pytest.approx(-2.0)  # output token, negative: multiplied
    assert processed[0, 2].item() == pytest.approx(1.5)  # unseen: untouched
    assert processed[0, 3].item() == pytest.approx(-1.5)
    # Token 0 was the argmax; after the penalty token 2 wins.
    assert Sampler()(logits, [seq], EOS).token_ids == [2]


def test_repetition_penalty_counts_a_repeated_token_once():
    logits = logits_of({0: 4.0})
    seq = make_seq(prompt=[0, 0, 0], output=[0, 0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler().process(logits, [seq], EOS)[0, 0].item() == pytest.approx(2.0)


def test_presence_and_frequency_penalties_use_output_tokens_only():
    logits = logits_of({0: 3.0, 1: 3.0, 2: 3.0})
    seq = make_seq(prompt=[0, 0], output=[1, 1, 1, 2], temperature=0.0,
                   presence_penalty=0.5, frequency_penalty=0.25)
    processed = Sampler().process(logits, [seq], EOS)[0]
    assert processed[0].item() == pytest.approx(3.0)  # only in the prompt: no penalty
    assert processed[1].item() == pytest.approx(3.0 - 3 * 0.25 - 0.5)
    assert processed[2].item() == pytest.approx(3.0 - 1 * 0.25 - 0.5)
    assert Sampler()(logits, [seq], EOS).token_ids == [0]


def test_negative_presence_penalty_encourages_repeats():
    logits = logits_of({0: 3.0, 1: 2.9})
    seq = make_seq(output=[1], temperature=0.0, presence_penalty=-1.0)
    assert Sampler()(logits, [seq], EOS).token_ids == [1]


def test_penalties_touch_only_their_own_rows():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    seqs = [make_seq(output=list(range(V)), temperature=0.0, rid="a"),
            make_seq(output=list(range(V)), temperature=0.0, repetition_penalty=3.0, frequency_penalty=1.0,
                     rid="b"),
            make_seq(output=list(range(V)), temperature=0.0, rid="c")]
    processed = Sampler().process(logits, seqs, EOS)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[2], logits[2])
    assert not torch.equal(processed[1], logits[1])


# ---- bans -------------------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = logits_of({15: 9.0, 7: 8.0, 3: 1.0})
    seq = make_seq(output=[3], temperature=0.0, min_tokens=3, stop_token_ids=[7])
    assert Sampler()(logits, [seq], EOS).token_ids == [3]
    seq.append_token(3)
    assert Sampler()(logits, [seq], EOS).token_ids == [3]  # 2 outputs < 3
    seq.append_token(3)
    assert Sampler()(logits, [seq], EOS).token_ids == [15]  # reached: eos allowed again


def test_ignore_eos_does_not_mask_eos():
    logits = logits_of({15: 9.0, 3: 1.0})
    seq = make_seq(temperature=0.0, ignore_eos=True)
    assert Sampler()(logits, [seq], EOS).token_ids == [15]


def test_eos_ids_outside_the_vocab_are_ignored():
    logits = logits_of({15: 9.0, 3: 1.0})
    seq = make_seq(temperature=0.0, min_tokens=2)
    assert Sampler()(logits, [seq], {15, 10_000}).token_ids == [3]


def test_single_token_bad_word_is_always_banned():
    logits = logits_of({5: 9.0, 6: 8.0})
    seq = make_seq(temperature=0.0, bad_word_ids=[[5]])
    out = Sampler()(logits, [seq], EOS)
    assert out.token_ids == [6]


def test_multi_token_bad_word_bans_last_token_only_after_its_prefix():
    logits = logits_of({5: 9.0, 6: 8.0})
    word = [[3, 4, 5]]
    assert Sampler()(logits, [make_seq(output=[3], temperature=0.0, bad_word_ids=word)], EOS).token_ids == [5]
    assert Sampler()(logits, [make_seq(output=[4, 4], temperature=0.0, bad_word_ids=word)], EOS).token_ids == [5]
    assert Sampler()(logits, [make_seq(output=[9, 3, 4], temperature=0.0, bad_word_ids=word)], EOS).token_ids == [6]


def test_bad_word_prefix_in_prompt_does_not_count():
    logits = logits_of({5: 9.0, 6: 8.0})
    seq = make_seq(prompt=[3, 4], output=[], temperature=0.0, bad_word_ids=[[3, 4, 5]])
    assert Sampler()(logits, [seq], EOS).token_ids == [5]
    seq2 = make_seq(prompt=[3], output=[4], temperature=0.0, bad_word_ids=[[3, 4, 5]])
    assert Sampler()(logits, [seq2], EOS).token_ids == [5]


def test_bans_apply_to_sampled_rows_too():
    logits = logits_of({5: 20.0, 6: 0.0})
    seq = make_seq(temperature=1.0, bad_word_ids=[[5]], seed=3)
    for _ in range(20):
        assert Sampler(seed=0)(logits, [seq], EOS).token_ids != [5]


# ---- truncation and distribution --------------------------------------------------------------------

def draw_many(logits_row: torch.Tensor, n: int = 2000, **params) -> torch.Tensor:
    """Sample n times in one batched call (n identical rows, shared generator)."""
    shared = SamplingParams(**params)
    seqs = [Sequence(str(i), [1, 2], shared, max_tokens=64) for i in range(n)]
    out = Sampler(seed=1234)(logits_row.expand(n, -1).contiguous(), seqs, EOS)
    return torch.bincount(torch.tensor(out.token_ids), minlength=V)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
ROW = torch.log(PROBS.clamp_min(1e-30))  # 4 live tokens with known probabilities


def test_sampling_matches_the_softmax_distribution():
    counts = draw_many(ROW, temperature=1.0)
    freq = counts.float() / counts.sum()
    assert counts[4:].sum() == 0
    assert torch.allclose(freq[:4], PROBS[:4], atol=0.035), freq[:4]


def test_temperature_flattens_and_sharpens():
    hot = draw_many(ROW, temperature=2.0).float() / 2000
    cold = draw_many(ROW, temperature=0.25).float() / 2000
    expect_hot = torch.softmax(ROW / 2.0, -1)
    expect_cold = torch.softmax(ROW / 0.25, -1)  # [0.88, 0.11, 0.007, ...]
    assert torch.allclose(hot[:4], expect_hot[:4], atol=0.035)
    assert torch.allclose(cold[:4], expect_cold[:4], atol=0.035)


@pytest.mark.parametrize("top_k, allowed", [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (0, {0, 1, 2, 3}),
                                             (-1, {0, 1, 2, 3})])
def test_top_k_keeps_k_most_likely(top_k, allowed):
    counts = draw_many(ROW, temperature=1.0, top_k=top_k)
    assert {i for i in range(V) if counts[i] > 0} == allowed


@pytest.mark.parametrize("top_p, allowed", [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, allowed):
    counts = draw_many(ROW, temperature=1.0, top_p=top_p)
    assert {i for i in range(V) if counts[i] > 0} == allowed


def test_top_p_renormalises():
    freq = draw_many(ROW, temperature=1.0, top_p=0.7).float() / 2000
    assert freq[0].item() == pytest.approx(0.5 / 0.8, abs=0.035)


@pytest.mark.parametrize("min_p, allowed", [(0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0}), (0.05, {0, 1, 2, 3})])
def test_min_p_drops_tokens_below_fraction_of_top(min_p, allowed):
    counts = draw_many(ROW, temperature=1.0, min_p=min_p)
    assert {i for i in range(V) if counts[i] > 0} == allowed


def test_heterogeneous_batch_applies_each_rows_own_params():
    logits = ROW.expand(4, -1).contiguous()
    seqs = [make_seq(temperature=0.0, rid="g"), make_seq(temperature=1.0, top_k=1, rid="k"),
            make_seq(temperature=1.0, top_p=0.4, rid="p"), make_seq(temperature=1.0, min_p=0.9, rid="m")]
    for _ in range(30):
        assert Sampler()(logits, seqs, EOS).token_ids == [0, 0, 0, 0]


def test_greedy_row_in_mixed_batch_respects_penalties():
    logits = ROW.expand(2, -1).contiguous()
    seqs = [make_seq(output=[0], temperature=0.0, presence_penalty=2.0, rid="g"),
            make_seq(temperature=1.0, top_k=1, rid="s")]
    assert Sampler()(logits, seqs, EOS).token_ids == [1, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=V, max_size=V),
       st.sampled_from([-1, 1, 2, 5, 20]), st.sampled_from([0.05, 0.3, 0.8, 1.0]),
       st.sampled_from([0.0, 0.1, 0.5]), st.sampled_from([0.3, 1.0, 3.0]), st.integers(0, 2**32))
def test_sampled_token_is_always_inside_the_truncated_set(row, top_k, top_p, min_p, temperature, seed):
    logits = torch.tensor(row)[None, :]
    seq = make_seq(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    out = Sampler()(logits, [seq], EOS)
    tok = out.token_ids[0]
    # Reference truncation, written independently; its cuts are widened by a hair (and ties kept)
    # so float rounding at a boundary cannot make it stricter than the sampler.
    probs = torch.softmax(logits[0] / temperature, -1).tolist()
    allowed = [i for i in range(V) if probs[i] >= min_p * max(probs) - 1e-7]
    if top_k > 0:
        allowed = [i for i in allowed if sum(probs[j] > probs[i] for j in allowed) < top_k]
    total = sum(probs[i] for i in allowed)
    if top_p < 1.0:
        allowed = [i for i in allowed
                   if sum(probs[j] for j in allowed if probs[j] > probs[i]) / total < top_p + 1e-5]
    assert tok in allowed
    assert out.logprobs[0] <= 1e-6 and math.isfinite(out.logprobs[0])


# ---- logprobs ---------------------------------------------------------------------------------------

def test_sampled_logprob_is_under_truncated_renormalised_distribution():
    logits = logits_of({0: 2.0, 1: 1.0, 2: 0.5})
    seq = make_seq(temperature=0.5, top_k=2, seed=7)
    out = Sampler()(logits, [seq], EOS)
    tok = out.token_ids[0]
    assert tok in (0, 1)
    scaled = torch.tensor([2.0, 1.0]) / 0.5
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(scaled, -1)[tok].item(), abs=1e-5)


def test_greedy_logprob_is_log_softmax_of_penalised_logits():
    logits = logits_of({0: 2.0, 1: 1.0})
    seq = make_seq(prompt=[9], output=[0], temperature=0.0, repetition_penalty=4.0)
    out = Sampler()(logits, [seq], EOS)
    processed = logits.clone()
    processed[0, 0] = 0.5  # 2.0 / 4 (output token)
    processed[0, 9] = -20.0  # -5.0 * 4 (prompt token)
    assert out.token_ids == [1]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(processed[0], -1)[1].item(), abs=1e-6)


# ---- seeds ------------------------------------------------------------------------------------------

def run_steps(sampler: Sampler, seqs: list[Sequence], steps: int, logits_fn) -> dict[str, list[int]]:
    """Sample `steps` tokens for each sequence, appending them, with per-request logits from logits_fn."""
    got: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    for step in range(steps):
        logits = torch.stack([logits_fn(s.request_id, step) for s in seqs])
        out = sampler(logits, seqs, EOS)
        for s, t in zip(seqs, out.token_ids):
            s.append_token(t)
            got[s.request_id].append(t)
    return got


def flat_logits(rid: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((rid, step)) % 2**31)
    return torch.randn(V, generator=g) * 0.3  # near uniform: the noise decides


def test_seeded_request_is_independent_of_its_batch():
    alone = run_steps(Sampler(seed=1), [make_seq(temperature=1.0, seed=42, rid="x")], 12, flat_logits)["x"]
    for batch_seed, others in [(2, 1), (3, 5), (99, 9)]:
        seqs = [make_seq(temperature=0.8, top_p=0.9, rid=f"o{i}") for i in range(others)]
        seqs.insert(others // 2, make_seq(temperature=1.0, seed=42, rid="x"))
        seqs.append(make_seq(temperature=0.0, repetition_penalty=1.3, rid="greedy"))
        seqs.append(make_seq(temperature=1.0, seed=7, rid="other-seeded"))
        got = run_steps(Sampler(seed=batch_seed), seqs, 12, flat_logits)
        assert got["x"] == alone


def test_same_seed_same_tokens_different_seed_different_tokens():
    a = run_steps(Sampler(), [make_seq(temperature=1.0, seed=5, rid="x")], 20, flat_logits)["x"]
    b = run_steps(Sampler(), [make_seq(temperature=1.0, seed=5, rid="x")], 20, flat_logits)["x"]
    c = run_steps(Sampler(), [make_seq(temperature=1.0, seed=6, rid="x")], 20, flat_logits)["x"]
    assert a == b
    assert a != c


def test_seed_at_top_of_range_is_accepted():
    seq = make_seq(temperature=1.0, seed=2**64 - 1)
    assert len(Sampler()(ROW[None, :], [seq], EOS).token_ids) == 1


def test_seeded_draw_is_the_inverse_transform_of_its_seeded_uniform():
    # Two live tokens of probability 1/4 and 3/4: token 0 exactly when u <= 1/4, for u of (seed, output index).
    row = torch.log(torch.tensor([0.25, 0.75] + [0.0] * (V - 2)).clamp_min(1e-30))
    for seed in range(40):
        seq = make_seq(temperature=1.0, seed=seed, output=[3] * (seed % 5))
        expected = 0 if seeded_uniform(seed, seq.num_output_tokens) <= 0.25 else 1
        assert Sampler()(row[None, :], [seq], EOS).token_ids == [expected]


def test_seeded_uniform_is_in_the_unit_interval_and_varies():
    draws = [seeded_uniform(seed, i) for seed in (0, 1, 2**64 - 1) for i in range(200)]
    assert all(0.0 < u <= 1.0 for u in draws)
    assert len(set(draws)) > 590
    assert abs(sum(draws) / len(draws) - 0.5) < 0.05


def test_unseeded_rows_reproducible_with_sampler_seed():
    a = run_steps(Sampler(seed=3), [make_seq(temperature=1.0, rid=str(i)) for i in range(4)], 8, flat_logits)
    b = run_steps(Sampler(seed=3), [make_seq(temperature=1.0, rid=str(i)) for i in range(4)], 8, flat_logits)
    c = run_steps(Sampler(seed=4), [make_seq(temperature=1.0, rid=str(i)) for i in range(4)], 8, flat_logits)
    assert a == b
    assert a != c


# ---- host work: penalty counts kept between steps, one copy per step ----------------------------------

def test_penalty_counts_follow_the_tokens_across_steps_and_reused_rows():
    # The sampler keeps counts between calls and adds only new tokens: after many steps, with a sequence
    # leaving and a new one taking its row at each, the processed logits equal those of a fresh sampler.
    torch.manual_seed(0)
    kept = Sampler()
    live = [make_seq(prompt=[1, 2, 2], temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                     presence_penalty=0.25, rid=str(i)) for i in range(5)]
    for step in range(14):
        logits = torch.randn(len(live), V)
        got = kept.process(logits, live, EOS)
        assert torch.equal(got, Sampler().process(logits, live, EOS)), f"step {step}"
        for seq in live:
            seq.append_token(int(torch.randint(V, ())))
        live = live[1:] + [make_seq(prompt=[step % V, 5], output=[step % 3], temperature=0.0,
                                    repetition_penalty=2.0, frequency_penalty=0.1, rid=f"n{step}")]
    assert kept.counts.output.shape[0] == 8  # 19 sequences passed through 8 rows


def test_a_sampled_step_makes_one_copy_of_host_values(monkeypatch):
    copies = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(a) or real(self, *a, **k))
    # On CUDA, torch.tensor(values, device=...) is a copy that waits for the forward: none may be made.
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("torch.tensor called in a sampled step"))
    seqs = [make_seq(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.2,
                     presence_penalty=0.5, seed=i if i % 2 else None, bad_word_ids=[[3]], min_tokens=4,
                     output=[1], rid=str(i)) for i in range(6)]
    seqs.append(make_seq(temperature=0.0, frequency_penalty=1.0, rid="g"))
    Sampler()(torch.randn(len(seqs), V), seqs, EOS)
    assert len(copies) == 1
