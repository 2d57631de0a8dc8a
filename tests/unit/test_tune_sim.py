"""The tuner's simulator (tuner.sim) under hand-made cost models: schedules computed by hand, and the
same scheduling decisions as the real engine, step by step, on a small trace (admissions, chunks, preemptions,
prefix hits)."""
from __future__ import annotations

import pytest

from engine_helpers import TINY
from tuner.cost import constant
from tuner.sim import SimRequest, simulate

KV = 1024  # bytes per token: only sizes the pool when num_kv_blocks is not given


def opts(**kw) -> dict:
    return {"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 4, "num_kv_blocks": 64,
            "threads": 1, **kw}


def test_two_requests_prefill_together_then_decode_in_lockstep():
    reqs = [SimRequest(0.0, list(range(10)), 3), SimRequest(0.0, list(range(100, 110)), 3)]
    res = simulate(reqs, opts(), constant(0.1), KV, record_steps=True)
    f = res.figures
    assert [s.scheduled for s in res.steps] == [[("0", 10), ("1", 10)], [("0", 1), ("1", 1)], [("0", 1), ("1", 1)]]
    assert f["ttft_p50_ms"] == pytest.approx(100) and f["ttft_p99_ms"] == pytest.approx(100)
    assert f["itl_p99_ms"] == pytest.approx(100) and f["e2e_p99_ms"] == pytest.approx(300)
    assert f["output_tok_s"] == pytest.approx(6 / 0.3) and f["steps"] == 3 and f["requests_done"] == 2


def test_chunked_prefill_delays_the_first_token_by_one_step_per_chunk():
    res = simulate([SimRequest(0.0, list(range(20)), 2)], opts(max_num_batched_tokens=8), constant(0.1), KV,
                   record_steps=True)
    assert [s.scheduled for s in res.steps] == [[("0", 8)], [("0", 8)], [("0", 4)], [("0", 1)]]
    assert res.figures["ttft_p99_ms"] == pytest.approx(300)
    assert res.figures["e2e_p99_ms"] == pytest.approx(400)


def test_a_request_arriving_mid_step_joins_at_the_next_step():
    reqs = [SimRequest(0.0, [1, 2, 3, 4], 3), SimRequest(0.05, [5, 6, 7, 8], 1)]
    res = simulate(reqs, opts(), constant(0.1), KV, record_steps=True)
    assert [s.scheduled for s in res.steps] == [[("0", 4)], [("0", 1), ("1", 4)], [("0", 1)]]
    assert [round(s.start_s, 6) for s in res.steps] == [0.0, 0.1, 0.2]
    f = res.figures
    assert f["ttft_p50_ms"] == pytest.approx((100 + 150) / 2)  # A: 0.1 after arrival; B: 0.2 - 0.05
    assert f["queue_p99_ms"] == pytest.approx(50, abs=1)  # B waited from 0.05 to the step at 0.1


def test_idle_time_is_skipped_to_the_next_arrival():
    reqs = [SimRequest(0.0, [1, 2], 1), SimRequest(5.0, [3, 4], 1)]
    res = simulate(reqs, opts(), constant(0.1), KV, record_steps=True)
    assert [round(s.start_s, 6) for s in res.steps] == [0.0, 5.0]
    assert res.figures["ttft_p99_ms"] == pytest.approx(100)
    assert res.figures["span_s"] == pytest.approx(5.1)


def test_warm_up_requests_fill_the_prefix_cache_and_count_in_no_figure():
    """verify's warm-up: served first, off the clock; the trace's request then finds its prompt's full blocks."""
    prompt = list(range(12))  # three full blocks of 4
    res = simulate([SimRequest(0.0, prompt, 2)], opts(), constant(0.1), KV, record_steps=True,
                   warm=[SimRequest(0.0, prompt, 4)])
    f = res.figures
    # the first two blocks come from the cache (the engine computes the last block of a fully cached prompt)
    assert [s.scheduled for s in res.steps] == [[("0", 4)], [("0", 1)]]
    assert f["requests_done"] == 1 and f["output_tokens"] == 2 and f["steps"] == 2
    assert f["ttft_p99_ms"] == pytest.approx(100) and f["prefill_tokens_saved"] == 8


def test_step_cost_grows_with_the_tokens_it_schedules():
    reqs = [SimRequest(0.0, list(range(10)), 2), SimRequest(0.0, list(range(50, 60)), 2)]
    f = simulate(reqs, opts(), constant(0.01, 0.001), KV).figures
    assert f["ttft_p99_ms"] == pytest.approx(30)  # 10 ms + 20 tokens x 1 ms
    assert f["e2e_p99_ms"] == pytest.approx(42)  # then a decode step of 2 tokens: 12 ms


def test_a_full_pool_preempts_the_newest_request_and_recomputes_it_after():
    # Pool of 4 blocks of 4 tokens; two 8-token prompts fill it, then the first decode needs a third block.
    o = opts(num_kv_blocks=4, watermark=0.0, enable_prefix_caching=False)
    reqs = [SimRequest(0.0, list(range(8)), 5), SimRequest(0.0, list(range(10, 18)), 5)]
    res = simulate(reqs, o, constant(0.1), KV, record_steps=True)
    steps = [(s.scheduled, s.preempted) for s in res.steps]
    assert steps[0] == ([("0", 8), ("1", 8)], [])
    assert steps[1] == ([("0", 1)], ["1"])  # newest admitted is the victim; nobody admitted in that step
    assert steps[2:5] == [([("0", 1)], [])] * 3  # request 0 runs to its end (5 tokens at 0.1 .. 0.5)
    assert steps[5] == ([("1", 9)], [])  # then 1 recomputes its prompt and its first output token
    f = res.figures
    assert f["preemptions"] == 1 and f["requests_done"] == 2
    assert f["e2e_p99_ms"] == pytest.approx(900, rel=0.02)  # 1's last token: 0.6 + 3 steps
    assert f["itl_p99_ms"] > 400  # 1 saw a 0.5 s gap while preempted


def test_refused_requests_are_counted_not_run():
    reqs = [SimRequest(0.0, list(range(30)), 10), SimRequest(0.0, [1, 2], 2)]
    f = simulate(reqs, opts(max_model_len=32), constant(0.1), KV).figures
    assert f["rejected"] == 1 and f["requests_done"] == 1


def test_sla_stops_a_hopeless_run_early():
    reqs = [SimRequest(i * 0.01, list(range(i * 100, i * 100 + 8)), 50) for i in range(200)]
    sla = {"ttft_p99_ms": 200, "itl_p99_ms": 1000}
    full = simulate(reqs, opts(max_num_seqs=2), constant(0.1), KV)
    early = simulate(reqs, opts(max_num_seqs=2), constant(0.1), KV, sla=sla)
    assert full.figures["ttft_p99_ms"] > 200 and not full.stopped_early
    assert early.stopped_early.startswith("ttft") and early.figures["steps"] < full.figures["steps"] / 10


def _engine_decisions(options: dict, reqs: list[SimRequest]) -> list[tuple[list, list]]:
    """The real engine (tiny-llama forward) on the same trace, arrivals joining at the same step boundaries
    as in the simulator with a cost of 1 s a step: what its scheduler decided at each step."""
    from inflight import EngineConfig, SamplingParams
    from inflight.engine import LLMEngine
    from tuner.sim import engine_config

    names = set(EngineConfig.__dataclass_fields__)
    # The simulator replays the scheduler without drafts: the engine it is compared with drafts none either.
    cfg = engine_config({**{k: v for k, v in options.items() if k in names}, "model": TINY,
                         "speculative_method": "off"})
    engine = LLMEngine(cfg)
    decisions = []
    original = engine.scheduler.schedule

    def recording(members=None):
        out = original(members)
        decisions.append(([(s.request_id, n) for s, n in out.scheduled], [s.request_id for s in out.preempted]))
        return out

    engine.scheduler.schedule = recording
    now, i = 0.0, 0
    while i < len(reqs) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and reqs[i].arrival_s > now:
            now = reqs[i].arrival_s
        while i < len(reqs) and reqs[i].arrival_s <= now:
            r = reqs[i]
            engine.add_request(str(i), r.prompt_ids, SamplingParams(max_tokens=r.output_tokens, temperature=0.0,
                                                                    ignore_eos=True), priority=r.priority)
            i += 1
        engine.step()
        now += 1.0
    return decisions


def test_simulator_and_engine_make_the_same_decisions_step_by_step():
    shared = list(range(1000, 1012))  # three blocks of 4 shared by half the requests (prefix hits)
    reqs = []
    for k in range(10):
        prompt = (shared if k % 2 else []) + [2000 + 37 * k + j for j in range(5 + 3 * k)]
        reqs.append(SimRequest(0.5 * k, prompt, 4 + (k * 5) % 9, priority=(1 if k == 7 else 0)))
    # A small budget (chunks), 5 seats, and a pool too small for all of them (preemptions).
    options = opts(max_num_seqs=5, max_num_batched_tokens=16, num_kv_blocks=22, watermark=0.0,
                   fast_lane_share=0.25, max_model_len=64)
    sim = simulate(reqs, options, constant(1.0), KV, record_steps=True)
    sim_decisions = [(s.scheduled, s.preempted) for s in sim.steps]
    engine_decisions = _engine_decisions(options, reqs)
    assert sim.figures["preemptions"] > 0, "the trace must exercise preemption"
    assert sim.figures["prefill_tokens_saved"] > 0, "the trace must exercise prefix hits"
    prompt_len = {str(i): len(r.prompt_ids) for i, r in enumerate(reqs)}
    assert any(1 < n < prompt_len[rid] for step, _ in sim_decisions for rid, n in step), "no chunked prefill"
    for k, (a, b) in enumerate(zip(sim_decisions, engine_decisions)):
        assert a == b, f"step {k}: simulator {a} != engine {b}"
    assert len(sim_decisions) == len(engine_decisions)
