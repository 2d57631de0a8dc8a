"""Property tests of the block manager and scheduler under random arrivals, lengths and aborts (no model)."""
import random

from hypothesis import given, settings, strategies as st

from inflight.block_manager import BlockManager
from inflight.config import EngineConfig
from inflight.scheduler import Scheduler
from inflight.sequence import SamplingParams, Sequence, SequenceStatus

request = st.tuples(
    st.integers(1, 90),   # prompt length
    st.integers(1, 40),   # max tokens
    st.integers(-1, 2),   # priority
    st.integers(0, 3),    # arrival step
    st.booleans(),        # aborted midway
    st.integers(0, 2),    # shared-prefix group (exercises the prefix cache)
)


def simulate(requests, num_blocks, budget, max_seqs, block_size, prefix_caching, chunked, seed):
    cfg = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, max_model_len=4096 if chunked else budget,
                       enable_prefix_caching=prefix_caching,
                       enable_chunked_prefill=chunked)
    sched = Scheduler(cfg, num_blocks)
    bm = sched.bm
    rng = random.Random(seed)
    pending = sorted(enumerate(requests), key=lambda x: x[1][3])
    live, done, rejected = {}, set(), set()
    step = 0
    preemptions_seen = 0
    while pending or sched.num_unfinished:
        while pending and pending[0][1][3] <= step:
            i, (plen, mtok, prio, _, _, group) = pending.pop(0)
            prompt = [group * 1000 + t for t in range(plen)] if group else [rng.randrange(50_000) for _ in range(plen)]
            if bm.blocks_needed(plen + mtok) > num_blocks or (not chunked and plen + mtok > budget):
                rejected.add(str(i))  # the engine refuses these at add_request
                continue
            seq = Sequence(str(i), prompt, SamplingParams(max_tokens=mtok), mtok, prio)
            live[str(i)] = seq
            sched.add(seq)
        out = sched.schedule()
        preemptions_seen += len(out.preempted)
        # Token budget and sequence cap are never exceeded; nobody is scheduled twice.
        assert out.num_batched_tokens <= budget
        assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
        assert len(sched.running) <= max_seqs
        for seq, n in out.scheduled:
            assert n >= 1 and seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens + n <= len(seq)
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n
        sched.advance(out.scheduled)
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(50_000))
                if seq.num_output_tokens >= seq.max_tokens:
                    sched.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    done.add(seq.request_id)
                    del live[seq.request_id]
        # Random aborts, wherever the request is.
        for rid, seq in list(live.items()):
            if requests[int(rid)][4] and rng.random() < 0.1:
                sched.remove(seq)
                done.add(rid)
                del live[rid]
        bm.check_invariants(list(sched.running) + list(sched.waiting))
        for seq in sched.waiting:
            assert not seq.block_table, "a waiting request holds blocks"
        step += 1
        assert step < 5000, "no progress: livelock"
    assert done | rejected == {str(i) for i in range(len(requests))}
    assert len(done) + len(rejected) == len(requests)
    assert bm.is_whole()
    return preemptions_seen


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=24), st.integers(4, 40), st.integers(8, 128), st.integers(1, 12),
       st.sampled_from([4, 8, 16]), st.booleans(), st.booleans(), st.integers(0, 1000))
def test_random_workloads_keep_every_invariant(requests, num_blocks, budget, max_seqs, block_size, prefix, chunked,
                                               seed):
    simulate(requests, num_blocks, budget, max_seqs, block_size, prefix, chunked, seed)


def test_tight_pool_preempts_and_still_finishes_everything():
    requests = [(30, 30, 0, 0, False, 0) for _ in range(12)]
    preemptions = simulate(requests, num_blocks=12, budget=64, max_seqs=12, block_size=8, prefix_caching=False,
                           chunked=True, seed=1)
    assert preemptions > 0


def test_preempted_request_returns_to_front_and_no_admission_in_that_step():
    cfg = EngineConfig(block_size=4, num_kv_blocks=4, max_num_batched_tokens=64, max_num_seqs=8,
                       enable_prefix_caching=False, watermark=0.0)
    sched = Scheduler(cfg, 4)
    a = Sequence("a", list(range(8)), SamplingParams(max_tokens=9), 9)
    b = Sequence("b", list(range(8)), SamplingParams(max_tokens=9), 9)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["a", "b"]  # 2 blocks each: pool full
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        seq.append_token(1)
    late = Sequence("late", [1], SamplingParams(max_tokens=1), 1)
    sched.add(late)
    out = sched.schedule()  # both need a third block at position 8 (the first output token): b (newest) is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert sched.waiting[0] is b and b.status == SequenceStatus.PREEMPTED and not b.block_table
    assert late.status == SequenceStatus.WAITING, "admitted in a step that preempted"
    assert [s.request_id for s, _ in out.scheduled] == ["a"]


def test_lower_priority_value_is_served_first_and_preempted_last():
    cfg = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=8,
                       fast_lane_share=0.0, fast_lane_max_prompt_tokens=0)
    sched = Scheduler(cfg, 64)
    low = Sequence("low", list(range(8)), SamplingParams(max_tokens=100), 100, priority=5)
    high = Sequence("high", list(range(8)), SamplingParams(max_tokens=100), 100, priority=0)
    sched.add(low)
    sched.add(high)
    out = sched.schedule()
    assert [s.request_id for s, _ in out.scheduled] == ["high"]


def test_waiting_request_that_does_not_fit_does_not_block_later_ones():
    cfg = EngineConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=64, max_num_seqs=8, watermark=0.0,
                       enable_prefix_caching=False)
    sched = Scheduler(cfg, 10)
    holder = Sequence("holder", list(range(20)), SamplingParams(max_tokens=4), 4)
    sched.add(holder)
    sched.schedule()  # takes 5 blocks
    big = Sequence("big", list(range(30)), SamplingParams(max_tokens=4), 4)  # needs 8 > 5 free
    small = Sequence("small", list(range(6)), SamplingParams(max_tokens=4), 4)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    ids = [s.request_id for s, _ in out.scheduled]
    assert "small" in ids and "big" not in ids


def test_long_prompt_is_chunked_under_the_budget():
    cfg = EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    sched = Scheduler(cfg, 64)
    seq = Sequence("long", list(range(100)), SamplingParams(max_tokens=2), 2)
    sched.add(seq)
    chunks = []
    while seq.num_computed_tokens < len(seq):
        out = sched.schedule()
        (s, n), = out.scheduled
        chunks.append(n)
        s.num_computed_tokens += n
    assert chunks == [32, 32, 32, 4]


def test_fast_lane_keeps_its_share_while_normal_requests_wait():
    cfg = EngineConfig(block_size=16, num_kv_blocks=256, max_num_batched_tokens=100, max_num_seqs=64,
                       fast_lane_share=0.25, fast_lane_max_prompt_tokens=16, fast_lane_max_tokens=8)
    sched = Scheduler(cfg, 256)
    for i in range(3):
        sched.add(Sequence(f"normal{i}", list(range(200)), SamplingParams(max_tokens=50), 50))
    for i in range(4):
        sched.add(Sequence(f"fast{i}", list(range(10)), SamplingParams(max_tokens=4), 4))
    out = sched.schedule()
    by_lane = {"fast": 0, "normal": 0}
    for s, n in out.scheduled:
        by_lane["fast" if s.is_fast_lane else "normal"] += n
    assert by_lane["fast"] == 25  # exactly its share (the third short prompt is chunked)
    assert by_lane["normal"] == 75  # the normal lane is not starved: it gets all the rest


def test_prefix_cache_shares_blocks_and_counts_hits():
    bm = BlockManager(32, 4, True)
    first = Sequence("a", list(range(13)), SamplingParams(max_tokens=1), 1)
    bm.admit(first)
    bm.allocate(first, 13)
    first.num_computed_tokens = 13
    bm.register_full_blocks(first)
    second = Sequence("b", list(range(12)) + [99, 98], SamplingParams(max_tokens=1), 1)
    cached = bm.admit(second)
    assert cached == 12 and second.block_table == first.block_table[:3]
    assert all(bm.blocks[b].ref_count == 2 for b in second.block_table)
    bm.free(first)
    bm.free(second)
    assert bm.is_whole() and len(bm.evictable) == 3  # cached blocks stay findable until evicted
    third = Sequence("c", list(range(12)) + [5], SamplingParams(max_tokens=1), 1)
    assert bm.admit(third) == 12
    bm.free(third)
