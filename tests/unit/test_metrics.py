"""Engine metrics: histogram buckets, the engine-side hooks, and snapshots read from another thread."""
from __future__ import annotations

import threading

import pytest

from inflight.metrics import (GAUGE_NAMES, INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS,
                              EngineMetrics, Histogram, token_buckets)
from inflight.sequence import FinishReason, SamplingParams, Sequence


def make_seq(arrival: float = 100.0, rid: str = "r") -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(), max_tokens=16, arrival_time=arrival)


# ---- Histogram ----------------------------------------------------------------------------------

def test_histogram_uses_le_buckets_and_inf():
    h = Histogram([1.0, 2.0, 5.0])
    for v in (0.5, 1.0, 1.0001, 2.0, 4.9, 5.0, 5.1, 1e9):
        h.observe(v)
    assert h.counts == [2, 2, 2, 2]  # (..1], (1..2], (2..5], (5..+Inf)
    assert h.cumulative_counts() == [2, 4, 6, 8]
    assert h.count == 8
    assert h.sum == pytest.approx(0.5 + 1.0 + 1.0001 + 2.0 + 4.9 + 5.0 + 5.1 + 1e9)


def test_histogram_observe_n_times():
    h = Histogram([1.0])
    h.observe(0.25, n=4)
    assert h.counts == [4, 0] and h.count == 4 and h.sum == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [[], [2.0, 1.0], [1.0, 1.0], [1.0, float("inf")], [float("nan")]])
def test_histogram_rejects_bad_buckets_naming_them(bad):
    with pytest.raises(ValueError, match="buckets="):
        Histogram(bad)


def test_bucket_constants_are_vllm_like_and_valid():
    for bounds in (TTFT_BUCKETS, INTER_TOKEN_BUCKETS, REQUEST_LATENCY_BUCKETS):
        Histogram(bounds)
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0
    assert {0.01, 0.025, 0.05, 0.075, 0.1}.issubset(INTER_TOKEN_BUCKETS)
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_token_buckets_are_powers_of_two_capped_by_budget():
    assert token_buckets(1) == (1.0,)
    assert token_buckets(512) == (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0)
    assert token_buckets(600)[-2:] == (512.0, 600.0)
    with pytest.raises(ValueError, match="max_tokens=0"):
        token_buckets(0)


# ---- engine-side hooks --------------------------------------------------------------------------

def hist(m: EngineMetrics, name: str) -> dict:
    return m.snapshot()["histograms"][name]


def test_queue_time_recorded_on_first_schedule_only():
    m = EngineMetrics()
    seq = make_seq(arrival=10.0)
    m.on_scheduled(seq, 10.25)
    m.on_scheduled(seq, 50.0)  # rescheduled after preemption: not a second queue time
    h = hist(m, "request_queue_time_seconds")
    assert h["count"] == 1 and h["sum"] == pytest.approx(0.25)


def test_queue_time_does_not_depend_on_engine_setting_seq_fields_first():
    m = EngineMetrics()
    seq = make_seq(arrival=10.0)
    seq.first_scheduled_time = 10.5  # the engine may stamp the record before telling us
    m.on_scheduled(seq, 10.5)
    assert hist(m, "request_queue_time_seconds")["sum"] == pytest.approx(0.5)


def test_ttft_then_inter_token_gaps():
    m = EngineMetrics()
    seq = make_seq(arrival=0.0)
    seq.first_token_time = seq.last_token_time = 0.5  # engine-set fields must not confuse us
    m.on_tokens(seq, 1, 0.5)
    m.on_tokens(seq, 1, 0.53125)
    m.on_tokens(seq, 2, 0.59375)  # two tokens sharing a 0.0625 s gap: 0.03125 each
    ttft = hist(m, "time_to_first_token_seconds")
    itl = hist(m, "inter_token_latency_seconds")
    assert ttft["count"] == 1 and ttft["sum"] == pytest.approx(0.5)
    assert itl["count"] == 3 and itl["sum"] == pytest.approx(0.09375)
    assert itl["counts"][itl["buckets"].index(0.05)] == 3  # all three in (0.025, 0.05]
    assert m.snapshot()["counters"]["generation_tokens_total"] == 4


def test_ttft_is_per_request():
    m = EngineMetrics()
    a, b = make_seq(0.0, "a"), make_seq(1.0, "b")
    m.on_tokens(a, 1, 2.0)
    m.on_tokens(b, 1, 2.0)
    assert hist(m, "time_to_first_token_seconds")["sum"] == pytest.approx(2.0 + 1.0)
    assert hist(m, "inter_token_latency_seconds")["count"] == 0


def test_on_finish_counts_by_reason_and_e2e():
    m = EngineMetrics()
    for i, reason in enumerate([FinishReason.EOS, FinishReason.EOS, FinishReason.LENGTH, FinishReason.CANCELLED]):
        seq = make_seq(arrival=0.0, rid=str(i))
        seq.finish_reason = reason
        m.on_finish(seq, 2.0 + i)
    snap = m.snapshot()
    assert snap["counters"]["requests_finished_total"] == {"eos": 2, "length": 1, "cancelled": 1}
    e2e = snap["histograms"]["e2e_request_latency_seconds"]
    assert e2e["count"] == 4 and e2e["sum"] == pytest.approx(2 + 3 + 4 + 5)


def test_counters_steps_and_prefix_hit_rate():
    m = EngineMetrics(max_num_batched_tokens=512)
    assert m.prefix_hit_rate == 0.0
    m.on_prompt_tokens(7)
    m.on_prompt_tokens(5)
    m.on_preemption()
    m.on_prefix_lookup(100, 25)
    m.on_prefix_lookup(100, 75)
    m.on_step(0.004, 300)
    snap = m.snapshot()
    c = snap["counters"]
    assert (c["prompt_tokens_total"], c["num_preemptions_total"]) == (12, 1)
    assert (c["prefix_cache_queries"], c["prefix_cache_hits"]) == (200, 100)
    assert m.prefix_hit_rate == snap["prefix_hit_rate"] == pytest.approx(0.5)
    tps = snap["histograms"]["tokens_per_step"]
    assert tps["buckets"][-1] == 512.0 and tps["counts"][tps["buckets"].index(512.0)] == 1
    assert snap["histograms"]["step_time_seconds"]["count"] == 1


def test_prefix_lookup_rejects_more_hits_than_queries():
    with pytest.raises(ValueError, match=r"num_hit_tokens=5 .*\[0, num_query_tokens=3\]"):
        EngineMetrics().on_prefix_lookup(3, 5)


def test_gauges_set_and_unknown_names_rejected():
    m = EngineMetrics()
    m.set_gauges(num_requests_running=3, kv_cache_usage=0.5)
    m.set_gauges(num_requests_waiting=2)
    g = m.snapshot()["gauges"]
    assert set(g) == set(GAUGE_NAMES)
    assert (g["num_requests_running"], g["num_requests_waiting"], g["kv_cache_usage"]) == (3, 2, 0.5)
    with pytest.raises(ValueError, match="num_requests_runing.*allowed.*num_requests_running"):
        m.set_gauges(num_requests_runing=1)


def test_snapshot_is_a_deep_copy():
    m = EngineMetrics()
    seq = make_seq()
    seq.finish_reason = FinishReason.STOP
    m.on_finish(seq, 101.0)
    snap = m.snapshot()
    snap["histograms"]["e2e_request_latency_seconds"]["counts"][0] = 999
    snap["counters"]["requests_finished_total"]["stop"] = 999
    snap["gauges"]["kv_blocks_used"] = 999
    fresh = m.snapshot()
    assert fresh["counters"]["requests_finished_total"]["stop"] == 1
    assert 999 not in fresh["histograms"]["e2e_request_latency_seconds"]["counts"]
    assert fresh["gauges"]["kv_blocks_used"] == 0
    m.on_finish(seq, 102.0)
    assert snap["histograms"]["e2e_request_latency_seconds"]["count"] == 1  # old snapshot unchanged


def test_finished_requests_leave_no_per_request_state():
    m = EngineMetrics()
    seq = make_seq()
    m.on_scheduled(seq, 100.1)
    m.on_tokens(seq, 1, 100.2)
    seq.finish_reason = FinishReason.EOS
    m.on_finish(seq, 100.3)
    assert len(m._scheduled) == 0 and len(m._last_token_at) == 0


def test_snapshots_from_another_thread_are_consistent():
    m = EngineMetrics()
    stop = threading.Event()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            snap = m.snapshot()
            for name, h in snap["histograms"].items():
                if sum(h["counts"]) != h["count"]:
                    bad.append(name)
            c = snap["counters"]
            # Written together under one lock hold: a torn read would show them apart.
            if c["prefix_cache_hits"] * 2 != c["prefix_cache_queries"]:
                bad.append("prefix")

    t = threading.Thread(target=reader)
    t.start()
    seqs = [make_seq(0.0, str(i)) for i in range(50)]
    for step in range(2000):
        for s in seqs[:10]:
            m.on_tokens(s, 1, step * 0.01)
        m.on_prefix_lookup(4, 2)
        m.on_step(0.01, 10)
        m.set_gauges(num_requests_running=10)
    stop.set()
    t.join()
    assert not bad
    snap = m.snapshot()
    assert snap["counters"]["generation_tokens_total"] == 20000
    assert snap["histograms"]["step_time_seconds"]["count"] == 2000
