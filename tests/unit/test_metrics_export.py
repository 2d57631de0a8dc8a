"""Metrics export (backend_src/serving/metrics_export.py): histograms replayed from bucket deltas keep
exact bucket counts and sums; counters only grow by deltas; everything from the exporting thread."""
import bisect
import random
import threading

import pytest

from inflight.metrics import INTER_TOKEN_BUCKETS, EngineMetrics, Histogram
from serving.metrics_export import COUNTERS, GAUGES, HISTOGRAMS, MetricsExporter, replay_values


class FakeMetric:
    def __init__(self, kind, buckets=None):
        self.kind, self.buckets = kind, buckets
        self.value = 0.0
        self.counts = [0] * (len(buckets) + 1) if buckets else None
        self.threads = set()

    def increment(self, v):
        assert v > 0
        self.threads.add(threading.get_ident())
        self.value += v

    def set(self, v):
        self.threads.add(threading.get_ident())
        self.value = v

    def observe(self, v):
        self.threads.add(threading.get_ident())
        self.counts[bisect.bisect_left(self.buckets, v)] += 1  # Prometheus "le" buckets
        self.value += v


class FakeSink:
    def __init__(self):
        self.metrics = {}

    def _add(self, name, labels, metric):
        key = (name, tuple(sorted(labels.items())))
        assert key not in self.metrics, f"{key} created twice"
        self.metrics[key] = metric
        return metric

    def counter(self, name, description, labels):
        return self._add(name, labels, FakeMetric("counter"))

    def gauge(self, name, description, labels):
        return self._add(name, labels, FakeMetric("gauge"))

    def histogram(self, name, description, labels, buckets):
        return self._add(name, labels, FakeMetric("histogram", buckets))

    def get(self, name, **labels):
        return self.metrics[(name, tuple(sorted({"model": "llm", **labels}.items())))]


@pytest.mark.parametrize("seed", range(20))
def test_replay_keeps_bucket_counts_and_sum(seed):
    rng = random.Random(seed)
    h = Histogram(INTER_TOKEN_BUCKETS)
    for _ in range(rng.randint(1, 200)):
        h.observe(rng.choice([0.0, rng.uniform(0, 0.01), rng.uniform(0, 2), rng.uniform(50, 200)]))
    values = replay_values(list(h.bounds), h.counts, h.sum)
    replayed = Histogram(INTER_TOKEN_BUCKETS)
    for v in values:
        replayed.observe(v)
    assert replayed.counts == h.counts
    assert replayed.sum == pytest.approx(h.sum, rel=1e-6, abs=1e-9)


def test_exporter_pushes_deltas_names_and_labels():
    m = EngineMetrics(max_num_batched_tokens=64)
    sink = FakeSink()
    ex = MetricsExporter(m.snapshot, sink, {"model": "llm"}, period_s=0.01)
    m.on_prompt_tokens(7)
    m.set_gauges(num_requests_running=2, kv_blocks_used=5, kv_blocks_free=11, kv_cache_usage=5 / 16)
    m.histograms["time_to_first_token_seconds"].observe(0.03)
    m.requests_finished_total["length"] = 1
    ex.export_once()
    m.on_prompt_tokens(3)
    m.histograms["time_to_first_token_seconds"].observe(0.7)
    m.requests_finished_total["length"] = 2
    m.requests_finished_total["cancelled"] = 1
    m.set_gauges(num_requests_running=0, kv_blocks_used=0, kv_blocks_free=16, kv_cache_usage=0.0)
    ex.export_once()
    ex.export_once()  # nothing new: nothing added
    assert sink.get("vllm:prompt_tokens_total").value == 10
    assert sink.get("vllm:request_success_total", finished_reason="length").value == 2
    assert sink.get("vllm:request_success_total", finished_reason="cancelled").value == 1
    assert sink.get("vllm:num_requests_running").value == 0
    assert sink.get("inflight:kv_blocks_free").value == 16
    assert sink.get("vllm:kv_cache_usage_perc").value == 0.0
    ttft = sink.get("vllm:time_to_first_token_seconds")
    assert sum(ttft.counts) == 2 and ttft.value == pytest.approx(0.73)
    assert ttft.counts == m.histograms["time_to_first_token_seconds"].counts
    names = {name for name, _ in sink.metrics}
    assert {e.name for e in HISTOGRAMS + COUNTERS + GAUGES} <= names
    assert "vllm:gpu_prefix_cache_hit_rate" in names


def test_speculative_decoding_counters_with_vllm_names_and_a_position_label():
    m = EngineMetrics(max_num_batched_tokens=64, num_speculative_tokens=3)
    sink = FakeSink()
    ex = MetricsExporter(m.snapshot, sink, {"model": "llm"}, period_s=0.01)
    m.on_spec_decode(2, 5, 3, [2, 1, 0])
    ex.export_once()
    m.on_spec_decode(1, 3, 3, [1, 1, 1])
    ex.export_once()
    assert sink.get("vllm:spec_decode_num_drafts_total").value == 3
    assert sink.get("vllm:spec_decode_num_draft_tokens_total").value == 8
    assert sink.get("vllm:spec_decode_num_accepted_tokens_total").value == 6
    assert [sink.get("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)).value
            for i in range(3)] == [3, 2, 1]
    with pytest.raises(ValueError, match=r"num_accepted=4 is out of range: allowed \[0, num_draft_tokens=3\]"):
        m.on_spec_decode(1, 3, 4, [1, 1, 1])


def test_exporter_thread_is_the_only_caller():
    m = EngineMetrics()
    sink = FakeSink()
    ex = MetricsExporter(m.snapshot, sink, {"model": "llm"}, period_s=0.005)
    ex.start()
    for _ in range(200):
        m.on_prompt_tokens(1)
    threading.Event().wait(0.05)
    ex.stop()
    threads = set().union(*(metric.threads for metric in sink.metrics.values()))
    assert threads == {ex._thread.ident}
    ex.export_once()  # the final tally (from this thread, now that the exporter stopped)
    assert sink.get("vllm:prompt_tokens_total").value == 200
