"""Speculative decoding through the engine: outputs equal those without drafts (greedy token for token; seeded
sampling too) for the fidelity prompts and repetitive ones, under chunked prefill, preemption, prefix hits, n
samples, stop strings, EOS, max_tokens, min_tokens and logprobs; drafts really verified (metrics); the pool whole
after every run and its invariants at every step."""
from __future__ import annotations

import pytest

from engine_helpers import SMOLLM2, TINY, TINY_GEMMA3, TINY_QWEN3, assert_pool_whole
from inflight import LLM, SamplingParams
from inflight.speculation import NgramProposer

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a trading port, then an industrial center, and finally a modern capital known for its museums, "
        "parks and universities. Visitors today walk along the old harbour, where merchants once unloaded "
        "spices, silk and tea from distant lands. ") * 6
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
REPETITIVE = [
    f"Rename the function total_price to compute_total in this code and show the whole code.\n\n{CODE}\n",
    f"Quote this paragraph exactly, word for word:\n\n{TEXT[:400]}\n\nQuote:",
    "Count from 1 to 40, separated by commas: 1, 2, 3,",
]
# Drafts for every decode, whatever the batch and whatever they cost: these tests are about outputs, not the
# break-even or the draft policy (test_speculation_policy.py; test_the_cost_policy_... below runs the default).
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
            speculative_disable_by_batch_size=64, speculative_draft_policy="always")
OFF = dict(speculative_method="off")
CONFIGS = {
    "ample": dict(num_kv_blocks=256, max_num_batched_tokens=2048),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=48),
    "preempting": dict(num_kv_blocks=40, max_num_batched_tokens=512, watermark=0.0),
}


def run(model: str, prompts, params, check_every_step: bool = True, **options):
    """Every output of every request as the engine delivered it: {(request, sample): [RequestOutput, ...]}, and
    the engine (its pool checked whole)."""
    llm = LLM(model, block_size=16, max_num_seqs=16, **options)
    engine = llm.engine
    if check_every_step:
        engine.step_hook = lambda: engine.block_manager.check_invariants(list(engine.seqs.values()))
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(f"r{i}", p, sp).request_id for i, (p, sp) in enumerate(zip(prompts, params))]
    outputs: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
    assert_pool_whole(engine)
    assert all(outs[-1].finished and not any(o.finished for o in outs[:-1]) for outs in outputs.values())
    return {key: outs for key, outs in sorted(outputs.items(), key=lambda kv: (ids.index(kv[0][0]), kv[0][1]))}, \
        engine


def summary(outputs) -> list[tuple]:
    """Per sample: tokens, streamed text, finish reason."""
    return [([t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs), outs[-1].finish_reason)
            for outs in outputs.values()]


def assert_same(got, want) -> None:
    """The same samples, tokens, text and finish reasons; cumulative logprobs equal within float32 noise (a step's
    row count picks the linears' kernels, so logits move by ~1e-5 relative, logprobs by ~3e-4 a token)."""
    assert summary(got) == summary(want)
    assert [outs[-1].cumulative_logprob for outs in got.values()] == pytest.approx(
        [outs[-1].cumulative_logprob for outs in want.values()], rel=1e-3, abs=1e-3)


def spec_counters(engine) -> dict:
    c = engine.metrics.snapshot()["counters"]
    return {k.removeprefix("spec_decode_"): v for k, v in c.items() if k.startswith("spec_decode_")}


def fidelity_prompts(llm_tokenizer) -> list[list[int]]:
    ids = llm_tokenizer.encode(TEXT)
    return [ids[:n] for n in (1, 7, 33, 150, 320)]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SMOLLM2)


@pytest.mark.parametrize("model", [TINY, SMOLLM2], ids=["tiny", "smollm2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_outputs_equal_without_drafts(model, config, smollm2_tokenizer):
    prompts = fidelity_prompts(smollm2_tokenizer) + REPETITIVE
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 12, 20, 9, 14, 40, 40, 40)]
    want, _ = run(model, prompts, params, **CONFIGS[config], **OFF)
    got, engine = run(model, prompts, params, **CONFIGS[config], **SPEC)
    assert_same(got, want)
    counters = spec_counters(engine)
    assert counters["num_accepted_tokens"] > 0, counters
    assert any(len(o.new_token_ids) > 1 for outs in got.values() for o in outs), "no step emitted several tokens"
    if config == "preempting":
        assert engine.scheduler.num_preemptions > 0


def test_decode_rows_of_a_verification_take_the_native_step_and_match_the_torch_forward(smollm2_tokenizer):
    """Up to cpu_gemv_rows rows a verification is one native decode call; with the native step off it runs the
    torch forward: both give the outputs of decoding without drafts."""
    prompts = REPETITIVE[:2]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want, _ = run(SMOLLM2, prompts, params, **OFF)
    options = dict(SPEC, num_speculative_tokens=3, speculative_disable_by_batch_size=1)
    got, engine = run(SMOLLM2, prompts, params, cpu_gemv_rows=4, **options)
    native = engine.runner.forward
    assert native.steps > 0, "the verification rows never ran as a native step"
    assert_same(got, want)
    got, _ = run(SMOLLM2, prompts, params, cpu_native_decode=False, **options)
    assert_same(got, want)


def test_prefix_hits_on_blocks_written_by_verification_are_exact():
    """A second request whose prompt is the first one's prompt and output reads blocks that verification steps
    filled and published: its continuation equals the one without drafts (a rejected draft's KV would show)."""
    prompt = REPETITIVE[1]
    first = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm = LLM(SMOLLM2, block_size=16, num_kv_blocks=256, **SPEC)
    out = llm.generate([prompt], first, use_tqdm=False)[0]
    continued = out.prompt_token_ids + out.token_ids
    hits_before = llm.engine.block_manager.prefix_hits
    got = llm.generate([continued], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert llm.engine.block_manager.prefix_hits - hits_before >= 16 * ((len(continued) - 1) // 16)
    assert spec_counters(llm.engine)["num_accepted_tokens"] > 0
    assert_pool_whole(llm.engine)
    want = LLM(SMOLLM2, block_size=16, num_kv_blocks=256, enable_prefix_caching=False, **OFF).generate(
        [continued], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert got.token_ids == want.token_ids


def test_rollbacks_across_block_boundaries_leak_nothing():
    """Blocks of 4 tokens and 4 drafts: most verifications cross a boundary, and many drafts are rejected
    (tiny-llama's n-gram guesses often fail); the invariants hold at every step and the pool ends whole."""
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want, _ = run(TINY, prompts, params, num_kv_blocks=200, **OFF)
    llm_opts = dict(num_kv_blocks=200, **SPEC)
    llm = LLM(TINY, block_size=4, max_num_seqs=16, **llm_opts)
    engine = llm.engine
    engine.step_hook = lambda: engine.block_manager.check_invariants(list(engine.seqs.values()))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [toks for toks, *_ in summary(want)]
    counters = spec_counters(engine)
    assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"], counters
    assert_pool_whole(engine)


def test_n_samples_and_seeded_sampling_equal_without_drafts():
    prompts = REPETITIVE
    params = [SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, seed=11, n=3),
              SamplingParams(max_tokens=30, temperature=0.0, n=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=1.0, top_k=5, seed=5, repetition_penalty=1.2,
                             frequency_penalty=0.3)]
    want, _ = run(SMOLLM2, prompts, params, **OFF)
    got, engine = run(SMOLLM2, prompts, params, **SPEC)
    again, _ = run(SMOLLM2, prompts, params, **SPEC)
    assert len(got) == 6
    assert_same(got, want)
    assert_same(again, want)
    assert spec_counters(engine)["num_accepted_tokens"] > 0


def test_stop_strings_eos_limits_and_logprobs_as_without_drafts():
    """A stop string that ends inside a run of accepted drafts, EOS under min_tokens, every max_tokens from 1 to 8,
    and logprobs: the same tokens, text, finish reason and log-probabilities; nothing past a stop is streamed."""
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    probe, _ = run(SMOLLM2, [REPETITIVE[2]], base, **OFF)
    text = summary(probe)[0][1]
    stop = text[30:36]  # inside the counting, where whole runs of drafts are accepted
    params = [SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
              SamplingParams(max_tokens=40, temperature=0.0, stop=["zzz", stop[2:]], logprobs=3),
              SamplingParams(max_tokens=60, temperature=0.0, min_tokens=25),
              SamplingParams(max_tokens=60, temperature=0.0)]
    params += [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in range(1, 9)]
    prompts = [REPETITIVE[2], REPETITIVE[2], "Say hi.", "Say hi."] + [REPETITIVE[0]] * 8
    want, _ = run(SMOLLM2, prompts, params, **OFF)
    got, engine = run(SMOLLM2, prompts, params, **SPEC)
    assert_same(got, want)
    stopped = summary(got)[0]
    assert stopped[2].value == "stop" and stop not in stopped[1] and text.startswith(stopped[1])
    final = list(got.values())[0][-1]
    assert len(final.new_token_ids) > 1, "the stop string did not end a multi-token verification step"
    # Logprobs: the same tokens, ranks and texts; values within float32 noise (a batch of more rows than the
    # native step takes runs oneDNN's linears, whose sums depend on the row count).
    g_lp = [t for o in list(got.values())[1] for t in o.logprobs]
    w_lp = [t for o in list(want.values())[1] for t in o.logprobs]
    assert len(g_lp) == len(w_lp) == len(summary(got)[1][0])
    for g, w in zip(g_lp, w_lp):
        assert (g.token_id, sorted((k, r, s) for k, (_, r, s) in g.top.items())) == \
            (w.token_id, sorted((k, r, s) for k, (_, r, s) in w.top.items()))
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)
        assert [g.top[k][0] for k in sorted(g.top)] == pytest.approx([w.top[k][0] for k in sorted(w.top)], abs=1e-3)
    assert [len(toks) for toks, *_ in summary(got)[4:]] == list(range(1, 9))
    assert summary(got)[2][2].value == "eos" and len(summary(got)[2][0]) >= 25
    assert spec_counters(engine)["num_accepted_tokens"] > 0


def test_the_cost_policy_drafts_some_steps_and_not_others_with_the_same_outputs():
    """The default policy (drafts only where they are expected to pay, by measured step costs) on copy-heavy
    prompts and an open-ended one, greedy and seeded at temperature 1: some steps verify drafts, others decode
    plainly, and every output equals the one without drafts."""
    prompts = REPETITIVE + ["Write a short story about a fox who learns to play the violin."] * 2
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)]
    want, _ = run(SMOLLM2, prompts, params, **OFF)
    options = dict(SPEC, speculative_draft_policy="cost", speculative_disable_by_batch_size=8)
    got, engine = run(SMOLLM2, prompts, params, **options)
    # The same tokens, text and finish reasons. Which steps draft depends on measured times, so the row counts,
    # and with them the linears' float32 rounding, differ from run to run: logprobs within a looser bound.
    assert summary(got) == summary(want)
    assert [outs[-1].cumulative_logprob for outs in got.values()] == pytest.approx(
        [outs[-1].cumulative_logprob for outs in want.values()], rel=1e-3, abs=1e-2)
    assert engine.speculator.costs.num_recorded > 0
    assert spec_counters(engine)["num_accepted_tokens"] > 0
    assert any(len(o.new_token_ids) == 1 for outs in got.values() for o in outs[1:])


def test_a_request_may_opt_out():
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculative_decoding=False)
    want, _ = run(SMOLLM2, REPETITIVE[:1], params, **OFF)
    got, engine = run(SMOLLM2, REPETITIVE[:1], params, **SPEC)
    assert_same(got, want)
    assert spec_counters(engine)["num_drafts"] == 0


def test_metrics_count_drafts_tokens_and_acceptance_per_position():
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    got, engine = run(SMOLLM2, REPETITIVE, params, **SPEC)
    c = spec_counters(engine)
    per_pos = c["num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and c["num_drafts"] > 0
    assert c["num_draft_tokens"] <= 4 * c["num_drafts"]
    assert sum(per_pos) == c["num_accepted_tokens"] <= c["num_draft_tokens"]
    assert per_pos[0] <= c["num_drafts"] and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    snap = engine.metrics.snapshot()
    num_tokens = sum(len(toks) for toks, *_ in summary(got))
    assert snap["counters"]["generation_tokens_total"] == num_tokens
    itl = snap["histograms"]["inter_token_latency_seconds"]
    ttft = snap["histograms"]["time_to_first_token_seconds"]
    assert itl["count"] + ttft["count"] == num_tokens  # tokens that arrived together each counted once


class FixedDrafts:
    """A proposer that drafts a chosen token after each possible first token (the Proposer interface)."""

    def __init__(self, drafts: dict[int, int]):
        self.drafts = drafts

    def propose(self, seq, max_tokens: int) -> list[int]:
        return [self.drafts[seq.token_ids[-1]]] if seq.token_ids[-1] in self.drafts else []

    def forget(self, seq) -> None:
        pass


def test_rejection_sampling_keeps_the_target_distribution():
    """tiny-llama at temperature 0.2 with min_p 0.2 (two to six likely tokens per position): the first token t0
    comes from a plain step, the second from verifying a one-token draft d(t0), t0's second likeliest follower.
    Over 2000 requests the (t0, t1) pairs must follow p(t0) p(t1 | t0) computed from the model's logits (Hugging
    Face, float64 softmax): a chi-square test at p = 0.001; and drafts are accepted at the rate p(d)."""
    import torch

    from engine_helpers import hf_model
    prompt = [5, 17, 42, 99, 7, 23]
    temperature, min_p = 0.2, 0.2
    params = SamplingParams(max_tokens=3, temperature=temperature, min_p=min_p, ignore_eos=True)
    model = hf_model(TINY)

    def target(ids: list[int]) -> dict[int, float]:
        """The sampler's distribution: softmax at the temperature, tokens under min_p x the top one cut."""
        with torch.inference_mode():
            probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, -1)
        keep = (probs >= min_p * probs.max()).nonzero().squeeze(1)
        kept = probs[keep] / probs[keep].sum()
        return dict(zip(keep.tolist(), kept.tolist()))

    p0 = target(prompt)
    p1 = {t0: target(prompt + [t0]) for t0 in p0}
    assert all(len(p) >= 2 for p in p1.values())
    drafts = {t0: sorted(p, key=p.get)[-2] for t0, p in p1.items()}
    llm = LLM(TINY, block_size=16, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024, **SPEC)
    llm.engine.speculator.proposer = FixedDrafts(drafts)
    num = 2000
    outs = llm.generate([prompt] * num, params, use_tqdm=False)
    counts: dict[tuple[int, int], int] = {}
    for out in outs:
        key = (out.token_ids[0], out.token_ids[1])
        counts[key] = counts.get(key, 0) + 1
    expected = {(t0, t1): num * p0[t0] * p1[t0][t1] for t0 in p0 for t1 in p1[t0]}
    assert set(counts) <= set(expected), "a token the target distribution excludes was emitted"
    chi2 = sum((counts.get(cell, 0) - e) ** 2 / e for cell, e in expected.items())
    df = len(expected) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * (2 / (9 * df)) ** 0.5) ** 3  # Wilson-Hilferty, p = 0.001
    assert chi2 < critical, (chi2, critical, counts, expected)
    c = spec_counters(llm.engine)
    assert c["num_drafts"] == num
    accept = sum(p0[t0] * p1[t0][drafts[t0]] for t0 in p0)
    assert 0.1 < accept < 0.9 and c["num_accepted_tokens"] / num == pytest.approx(accept, abs=0.04)
    assert_pool_whole(llm.engine)


def test_a_constrained_request_never_drafts_and_both_kinds_share_steps():
    """A request with a grammar beside repetitive ones: the grammar's request gets no drafts (its matcher would
    have to follow them), the others do, in the same steps; every output equals the one without drafts."""
    prompts = [REPETITIVE[2], "Answer with a date: when did the war end?", REPETITIVE[1]]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": "(1[0-9]{3}-){4}"}),
              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]
    want, _ = run(SMOLLM2, prompts, params, **OFF)
    asked: set[str] = set()
    propose = NgramProposer.propose

    def recording(self, seq, max_tokens):
        asked.add(seq.request_id)
        return propose(self, seq, max_tokens)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NgramProposer, "propose", recording)
        got, engine = run(SMOLLM2, prompts, params, **SPEC)
    assert_same(got, want)
    assert summary(got)[1][1].count("-") == 4
    assert asked == {"r0", "r2"}
    assert spec_counters(engine)["num_accepted_tokens"] > 0


@pytest.mark.parametrize("model,options", [(TINY_QWEN3, {}), (TINY_GEMMA3, {}), (SMOLLM2, {"quantization": "int8"})],
                         ids=["qwen3", "gemma3", "smollm2-int8"])
def test_other_families_and_quantized_weights_give_the_same_outputs(model, options):
    """Families on the torch forward (Qwen3's q/k norms, Gemma 3's sliding windows) and the quantized native
    product verify drafts as decode rows too."""
    prompts = [REPETITIVE[2], list(range(40, 60)) * 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want, _ = run(model, prompts, params, **options, **OFF)
    got, engine = run(model, prompts, params, **options, **SPEC)
    assert_same(got, want)
    assert spec_counters(engine)["num_drafts"] > 0
