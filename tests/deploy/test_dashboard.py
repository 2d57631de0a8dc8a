"""The dashboard and the alerts are real: real Prometheus (Debian's package) scrapes a live tritonserver with
docker/prometheus/prometheus.yml (targets swapped) and docker/prometheus/alerts.yml, load runs through both
A/B arms, and then every Grafana panel query and every alert expression must return data through
Prometheus' HTTP API. A metric renamed in the code (or in a query) leaves a query empty and fails here.

The test server is tiny-llama with `llm` tuned so every panel has something to show within a minute:
two instances (engines), a small KV pool (preemptions), a short queue (queue-full refusals) and the fault hook
(tests/fault_hooks.py, copied beside model.py) that makes one engine step fail (errors)."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest

import fault_hooks
from server_harness.load import traffic
from server_harness.prometheus import alert_queries, as_bool, panel_queries, resolve, run_prometheus, scrape_config
from server_harness.repository import build_repository, copy_model, instances
from server_harness.server import TritonServer, free_ports
from server_harness.stream_client import StreamClient

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "llm-serving.json"
PROMETHEUS_YML = ROOT / "docker" / "prometheus" / "prometheus.yml"
ALERTS = ROOT / "docker" / "prometheus" / "alerts.yml"
RATE_INTERVAL = "1m"  # covers the whole load below


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(server, prometheus) after the load; both still running while the tests query."""
    work = tmp_path_factory.mktemp("dashboard")
    source = ROOT / "model_repository"
    repo = build_repository(source, work / "model_repository", {"model": str(TINY)}, max_batch_size=8,
                            max_queue_delay_us=50_000)
    copy_model(source, "llm", repo, edit=instances(2), files=[fault_hooks.FILE],
               params={"model": str(TINY), "num_kv_blocks": "12", "max_num_seqs": "2", "max_queue_size": "2",
                       **fault_hooks.ON})
    with TritonServer(repo, log_path=work / "server.log", env={"OMP_NUM_THREADS": "1"}) as server:
        (port,) = free_ports(1)
        config = scrape_config(PROMETHEUS_YML, ALERTS, [f"127.0.0.1:{server.metrics_port}"], "1s", "1s")
        with run_prometheus(work / "prometheus", port, config) as prom:
            counts = load(server.grpc_url)
            print(f"load: {counts}")
            assert counts["ok"] > 20, counts
            time.sleep(3)  # a scrape and a rule evaluation after the last request
            yield server, prom
    assert server.leftovers() == []


def load(grpc_url: str) -> dict[str, int]:
    """Steady traffic on both arms, with bursts on `llm` past its queue and one injected engine error."""
    done: dict[str, int] = {}
    steady = threading.Thread(target=lambda: done.update(traffic(grpc_url, seconds=40, concurrency=6,
                                                                 max_tokens=(16, 80))))
    steady.start()
    client = StreamClient(grpc_url)
    try:
        for burst in range(3):
            time.sleep(8)
            ids = [f"burst{burst}-{i}" for i in range(12)]  # 2 instances x (2 running + 2 waiting) < 12
            for rid in ids:
                client.send("llm", rid, "Count slowly to fifty.", {"max_tokens": 40, "stream": True})
            client.wait_finals(120, ids=ids)
        client.send("llm", "fault", "Fail, please.", {"max_tokens": 30, "stream": True}, {"inject_fault": "error"})
        client.wait_finals(60, ids=["fault"])
    finally:
        client.close(cancel=True)
        steady.join()
    return done


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


@pytest.mark.parametrize("query", panel_queries(DASHBOARD), ids=lambda q: f"{q.title}|{q.legend}")
def test_every_panel_query_returns_data(live, query):
    _, prom = live
    result = prom.query(resolve(query.expr, RATE_INTERVAL))
    assert has_data(result), f"{query.title} ({query.legend}): no data for {resolve(query.expr, RATE_INTERVAL)}"


@pytest.mark.parametrize("query", alert_queries(ALERTS), ids=lambda q: q.title)
def test_every_alert_expression_has_data_and_loads_clean(live, query):
    _, prom = live
    expr = as_bool(query.expr)
    assert has_data(prom.query(expr)), f"{query.title}: no data for {expr}"
    (rule,) = [r for r in prom.rules() if r.get("name") == query.title]
    assert rule["health"] == "ok", rule


def test_engines_are_told_apart_by_instance(live):
    server, prom = live
    engines = prom.query('sum by (triton_instance) (vllm:request_success_total{model="llm"})')
    assert sorted(s["metric"].get("triton_instance") for s in engines) == ["llm_0_0", "llm_0_1"], engines
    # Both arms on one screen: the same latency histograms from the dynamic arm.
    models = {s["metric"]["model"] for s in prom.query("vllm:time_to_first_token_seconds_count")}
    assert {"llm", "llm_dynamic"} <= models, models
    (target,) = prom.targets()
    assert target["health"] == "up" and target["labels"]["instance"] == f"127.0.0.1:{server.metrics_port}"
