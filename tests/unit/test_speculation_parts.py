"""Speculative decoding without a model: the n-gram proposer against a brute-force search, the scheduler's drafts
(budget, blocks, no preemption for a draft), the rollback across block boundaries (no block lost, no rejected token
ever published in the prefix cache), the verification rule, and the settings' validation."""
import random

import pytest
from hypothesis import given, settings, strategies as st

from inflight.block_manager import BlockManager
from inflight.config import EngineConfig
from inflight.scheduler import Scheduler
from inflight.sequence import SamplingParams, Sequence, SequenceStatus
from inflight.speculation import DraftPosition, NgramProposer, Speculator, num_accepted, verification_rows

POISON = 1_000_000  # token ids of drafts that will be rejected: none may ever reach a published block


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The proposal by definition: longest n-gram in [lo, hi] whose latest earlier occurrence is followed by a
    token; copy from there, continuing into the draft itself past the end."""
    end = len(tokens)
    for n in range(hi, lo - 1, -1):
        if end <= n:
            continue
        key = tokens[end - n:]
        for start in range(end - 1, n - 1, -1):
            if tokens[start - n:start] == key:
                ctx = list(tokens)
                for j in range(k):
                    ctx.append(ctx[start + j])
                return ctx[end:]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 6), st.integers(1, 8))
def test_ngram_proposer_equals_brute_force_as_tokens_grow(tokens, lo, extra, k, step):
    hi = lo + extra
    proposer = NgramProposer(lo, hi)
    seq = Sequence("r", tokens[:1], SamplingParams(), 100)
    # The index is built incrementally while the sequence grows by a few tokens at a time, as in decoding.
    for end in range(1, len(tokens) + 1, step):
        seq.token_ids = seq.token_ids + tokens[len(seq.token_ids):end]
        assert proposer.propose(seq, k) == brute_force(seq.token_ids, lo, hi, k)


def test_ngram_proposer_prefers_longest_then_latest_and_continues_a_loop():
    proposer = NgramProposer(1, 3)
    seq = Sequence("r", [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3], SamplingParams(), 100)
    # "1 2 3" occurred once (followed by 9); the shorter "2 3" later (followed by 7) loses to the longer match.
    assert proposer.propose(seq, 3) == [9, 2, 3]
    loop = Sequence("l", [4, 8, 8, 8], SamplingParams(), 100)
    assert proposer.propose(loop, 4) == [8, 8, 8, 8]
    assert proposer.propose(Sequence("n", [1, 2, 3, 4], SamplingParams(), 100), 4) == []
    proposer.forget(seq)
    assert seq not in proposer._indexes


def test_speculator_drafts_only_decodes_that_allow_it_and_never_past_max_tokens():
    cfg = EngineConfig(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                       prompt_lookup_max=2, speculative_disable_by_batch_size=4)
    spec = Speculator.from_config(cfg)

    def decoding(rid, max_tokens, opt_out=False, outputs=1):
        seq = Sequence(rid, [5, 6, 5, 6, 5], SamplingParams(speculative_decoding=not opt_out), max_tokens)
        seq.token_ids += [6] * outputs
        seq.num_computed_tokens = len(seq) - 1
        return seq

    near_limit, free, opted_out = decoding("a", 3), decoding("b", 50), decoding("c", 50, opt_out=True)
    prefilling = decoding("d", 50)
    prefilling.num_computed_tokens = 2
    assert spec.propose([near_limit, free, opted_out, prefilling])
    assert near_limit.spec_token_ids == [5]  # 1 output + 1 draft + the next token = max_tokens
    assert free.spec_token_ids == [5, 6, 5, 6]
    assert opted_out.spec_token_ids == [] and prefilling.spec_token_ids == []
    for seq in (near_limit, free):
        seq.spec_token_ids = []
    assert not spec.propose([free, *(decoding(rid, 50) for rid in "efgh")])  # 5 running > 4
    assert free.spec_token_ids == []
    assert Speculator.from_config(EngineConfig(speculative_method="off")) is None
    assert Speculator.from_config(EngineConfig(device="cuda")) is None  # auto: off on CUDA
    assert Speculator.from_config(EngineConfig()) is not None  # auto: ngram on CPU


def test_draft_length_follows_what_the_requests_drafts_achieve():
    spec = Speculator.from_config(EngineConfig(speculative_method="ngram", num_speculative_tokens=5,
                                               prompt_lookup_min=1, prompt_lookup_max=1))
    seq = Sequence("r", [3] * 8, SamplingParams(), 100)
    seq.token_ids.append(3)
    seq.num_computed_tokens = 8

    def drafted() -> int:
        spec.propose([seq])
        n, seq.spec_token_ids = len(seq.spec_token_ids), []
        return n

    assert drafted() == 5
    spec.observe(seq, 5, 2)  # a rejection: one shorter
    assert drafted() == 4
    for _ in range(6):
        spec.observe(seq, 4, 0)
    assert drafted() == 1  # never below one
    spec.observe(seq, 1, 1)  # all held: two longer, up to num_speculative_tokens
    assert drafted() == 3
    spec.observe(seq, 3, 3)
    spec.observe(seq, 5, 5)
    assert drafted() == 5
    spec.forget(seq)
    assert seq not in spec._lengths


def test_settings_refuse_a_min_above_the_max_by_name_and_value():
    with pytest.raises(ValueError, match=r"prompt_lookup_min=5 is out of range: allowed \[1, prompt_lookup_max=3\]"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="speculative_method='eagle' is out of range: allowed auto, off, ngram"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"num_speculative_tokens=0 is out of range: allowed integers in \[1, 64\]"):
        EngineConfig.from_options(num_speculative_tokens="0")


def test_verification_rows_see_the_drafts_before_them():
    seq = Sequence("r", [1, 2, 3], SamplingParams(min_tokens=3), 10)
    seq.token_ids.append(4)
    rows = verification_rows(seq, [7, 8])
    assert rows[0] is seq and len(rows) == 3
    assert [r.num_output_tokens for r in rows] == [1, 2, 3]
    assert rows[2].token_ids == [1, 2, 3, 4, 7, 8] and len(rows[2]) == 6
    assert isinstance(rows[1], DraftPosition) and rows[1].forked and rows[1].params is seq.params
    assert seq.token_ids == [1, 2, 3, 4]  # the views copy, never touch the sequence
    assert num_accepted([7, 8], [7, 8, 9]) == 2
    assert num_accepted([7, 8], [7, 5, 9]) == 1
    assert num_accepted([7, 8], [6, 8, 9]) == 0


def _decoding_seq(bm: BlockManager, rid: str, prompt: list[int]) -> Sequence:
    seq = Sequence(rid, prompt, SamplingParams(max_tokens=50), 50)
    bm.admit(seq)
    bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.register_full_blocks(seq)
    seq.token_ids.append(7)  # the sampled token, KV not computed yet
    return seq


def test_rollback_across_a_block_boundary_frees_the_drafts_blocks_and_publishes_nothing_rejected():
    cfg = EngineConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, watermark=0.0)
    sched = Scheduler(cfg, 16)
    bm = sched.bm
    seq = _decoding_seq(bm, "r", [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed: blocks [full, 2 of 4]
    seq.status = SequenceStatus.RUNNING
    sched.running.append(seq)
    free_before = bm.num_free_blocks
    seq.spec_token_ids = [POISON + i for i in range(7)]  # positions 6-13: two blocks more
    sched.speculating = True
    out = sched.schedule()
    assert out.scheduled == [(seq, 8)] and out.drafted == [seq]
    assert len(seq.block_table) == 4 and bm.num_free_blocks == free_before - 2
    sched.advance(out.scheduled)
    assert seq.num_computed_tokens == 7  # the sampled token's KV only; the drafts wait for verification
    seq.token_ids.append(9)  # all drafts rejected: the step's one token
    sched.commit_drafts(seq, 0)
    assert seq.spec_token_ids == [] and seq.num_computed_tokens == 7 and len(seq.block_table) == 2
    assert bm.num_free_blocks == free_before
    bm.check_invariants([seq])
    assert all(POISON not in b.token_ids for b in bm.blocks)
    # Accepting two drafts that fill the second block publishes it, with the accepted tokens only.
    seq.spec_token_ids = [8, 10, POISON]
    sched.speculating = True
    out = sched.schedule()
    assert out.scheduled == [(seq, 4)]
    sched.advance(out.scheduled)
    seq.token_ids += [8, 10, 11]
    sched.commit_drafts(seq, 2)
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    published = [b.token_ids for b in bm.blocks if b.block_hash is not None]
    assert (5, 6, 7, 9) in published and all(POISON not in t for t in published)
    bm.check_invariants([seq])
    sched.remove(seq)
    assert bm.is_whole()


def test_drafts_take_only_what_the_budget_and_free_blocks_leave_and_never_preempt():
    cfg = EngineConfig(block_size=4, num_kv_blocks=6, max_num_batched_tokens=5, watermark=0.0)
    sched = Scheduler(cfg, 6)
    bm = sched.bm
    a, b = _decoding_seq(bm, "a", [1]), _decoding_seq(bm, "b", [4, 5, 6, 7, 8, 9])  # neither needs a new block
    for seq in (a, b):
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    a.spec_token_ids, b.spec_token_ids = [1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2]
    sched.speculating = True
    out = sched.schedule()
    # Budget 5: both decodes (2), then a's drafts take the 3 left; b's are dropped.
    assert dict((s.request_id, n) for s, n in out.scheduled) == {"a": 4, "b": 1}
    assert a.spec_token_ids == [1, 1, 1] and b.spec_token_ids == [] and not out.preempted
    sched.advance(out.scheduled)
    for seq in (a, b):
        seq.token_ids.append(3)
        sched.commit_drafts(seq, 0)
    # A pool with no free block: the drafts shrink to the room left in the sequence's last block.
    while bm.num_free_blocks:
        bm._take_block()
    a.spec_token_ids = [1, 1, 1, 1]
    sched.speculating = True
    out = sched.schedule()
    assert not out.preempted and dict((s.request_id, n) for s, n in out.scheduled)["a"] == 2
    assert a.spec_token_ids == [1]


request = st.tuples(st.integers(1, 30), st.integers(1, 25), st.integers(0, 1))  # prompt, max_tokens, shared


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=10), st.integers(8, 40), st.integers(4, 40), st.integers(1, 5),
       st.sampled_from([2, 4, 16]), st.integers(0, 10_000))
def test_scheduler_with_random_drafts_and_acceptance_keeps_the_pool_exact(requests, num_blocks, budget, k,
                                                                        block_size, seed):
    """Random drafts, random acceptance, preemption from a small pool, shared prefixes: every step stays within
    the budget and the pool's invariants, drafts never come with a preemption, no rejected token is ever
    published, and the pool is whole once every request is done."""
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                       max_num_seqs=8, max_model_len=4096, watermark=0.0)
    sched = Scheduler(cfg, num_blocks)
    bm, rng = sched.bm, random.Random(seed)
    for i, (plen, max_tokens, shared) in enumerate(requests):
        prompt = [500 + t for t in range(plen)] if shared else [rng.randrange(100) for _ in range(plen)]
        if bm.blocks_needed(plen + max_tokens + k) > num_blocks:
            continue
        seq = Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
        sched.add(seq)
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        for seq in sched.running:
            room = min(k, seq.max_tokens - seq.num_output_tokens - 1)
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens and room > 0:
                # The drafts verification will accept, then those it will reject (poison).
                length = rng.randint(0, room)
                good = rng.randint(0, length)
                seq.spec_token_ids = [rng.randrange(100) for _ in range(good)] + [POISON] * (length - good)
        sched.speculating = True
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert not (out.drafted and out.preempted)
        for seq, n in out.scheduled:
            assert n == seq.num_uncomputed_tokens + len(seq.spec_token_ids) or not seq.spec_token_ids
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        sched.advance(out.scheduled)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens < len(seq):
                continue  # a prefill chunk
            drafts = seq.spec_token_ids
            accepted = (drafts + [POISON]).index(POISON)
            for token in drafts[:accepted] + [rng.randrange(100)]:  # what the engine appends
                seq.token_ids.append(token)
                if seq.num_output_tokens >= seq.max_tokens:
                    break
            if seq.num_output_tokens >= seq.max_tokens:
                seq.status = SequenceStatus.FINISHED
                sched.remove(seq)
            else:
                sched.commit_drafts(seq, accepted)
        bm.check_invariants(sched.running)
        assert all(POISON not in b.token_ids for b in bm.blocks)
        for seq in sched.running:  # rolled back: blocks hold computed tokens only
            assert seq.spec_token_ids == [] and len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    assert not sched.num_unfinished
    assert bm.is_whole()
