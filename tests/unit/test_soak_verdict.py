"""perf.soak's verdict reads its memory limit: a process whose RSS grows past RSS_GROWTH_LIMIT_PCT after the
warm-up fails the run (a soak with tritonserver +23% once said PASSED), one within it passes."""
from perf.soak.report import RSS_GROWTH_LIMIT_PCT, RSS_JUDGED_MIN_S, Accounting, Sample, _markdown, summarize
from perf.soak.traffic import Outcome

DURATION_S = 600.0
POOL = 256


def clean_traffic() -> list[Outcome]:
    """Requests that all ended as expected, so that memory is the only thing the verdict can fail on."""
    return [Outcome("stream", f"r{i}", True, latency_s=0.5, ttft_s=0.05, sent_s=10.0 * i) for i in range(60)]


def series(tritonserver_growth_pct: float) -> list[Sample]:
    """Samples every 30 s: the stub flat at 900 MB, tritonserver growing linearly by the given share from the end
    of the warm-up (a tenth of the run) to the end; the KV pool whole throughout."""
    warm_at = DURATION_S / 10
    samples = []
    for i in range(int(DURATION_S // 30) + 1):
        t = 30.0 * i
        grown = max(0.0, (t - warm_at) / (DURATION_S - warm_at))
        samples.append(Sample(t_s=t, rss_mb={"llm_0_0": 900.0, "tritonserver": 400.0 * (1 + tritonserver_growth_pct
                                                                                     / 100 * grown)},
                              kv={"llm_0_0": (0.0, float(POOL))}, running=0, waiting=0, inflight=0, finished=6 * i,
                              preemptions=0, requests_sent=6 * i))
    return samples


def verdict(tritonserver_growth_pct: float) -> tuple[dict, str]:
    samples = series(tritonserver_growth_pct)
    accounting = Accounting(engine_bound=60, server_finished=60.0, pool_per_instance=POOL,
                            kv_end=samples[-1].kv)
    summary = summarize(clean_traffic(), samples, 0, 0, [], accounting, 0.0, DURATION_S)
    summary["leftovers"] = []
    config = {"duration_s": DURATION_S, "model": "SmolLM2", "num_kv_blocks": POOL, "concurrency": 4,
              "max_tokens": 48, "seed": 0, "server": "host", "started": "2026-12-07T00:00:00+00:00"}
    title = _markdown(config, summary, samples, sorted(samples[0].rss_mb), plotted=False).splitlines()[0]
    return summary, title


def test_tritonserver_growing_23_percent_fails_the_soak():
    assert DURATION_S >= RSS_JUDGED_MIN_S
    summary, title = verdict(23.0)
    assert summary["memory"]["tritonserver"]["growth_pct"] == 23.0
    assert summary["passed"] is False
    assert title.endswith("FAILED"), title


def test_growth_within_the_limit_passes():
    assert RSS_GROWTH_LIMIT_PCT > 3.0
    summary, title = verdict(3.0)
    assert summary["memory"]["tritonserver"]["growth_pct"] == 3.0
    assert summary["passed"] is True
    assert title.endswith("PASSED"), title


def test_a_run_too_short_to_judge_memory_says_so_rather_than_failing():
    samples = [Sample(t_s=t, rss_mb={"tritonserver": 400.0 + 3 * t}, kv={"llm_0_0": (0.0, float(POOL))},
                      running=0, waiting=0, inflight=0, finished=0, preemptions=0, requests_sent=0)
               for t in (0.0, 10.0, 20.0, 30.0)]
    accounting = Accounting(engine_bound=0, server_finished=0.0, pool_per_instance=POOL, kv_end=samples[-1].kv)
    summary = summarize([], samples, 0, 0, [], accounting, 0.0, 30.0)
    assert summary["memory"]["tritonserver"]["growth_pct"] > RSS_GROWTH_LIMIT_PCT
    assert (summary["rss_judged"], summary["rss_over_limit"], summary["passed"]) == (False, {}, True)
