"""One engine per model instance: `instance_group { count: 2 }` on the CPU gives two engines that serve at
once, each labelled by its Triton instance name in /metrics, each with half the cores' torch threads.
How Triton 2.51 hands requests of a decoupled model to its instances is measured here too (docker/README.md)."""
from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from server_harness.repository import build_repository, copy_model, instances
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
INSTANCES = ("llm_0_0", "llm_0_1")  # Triton's names: <group name = model_index>_<instance index>
SAMPLE = re.compile(r'^(?P<name>[\w:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("instances")
    source = ROOT / "model_repository"
    repo = build_repository(source, work / "model_repository", {"model": str(TINY)})
    copy_model(source, "llm", repo, params={"model": str(TINY), "metrics_interval_ms": "200"}, edit=instances(2))
    with TritonServer(repo, log_path=work / "server.log") as srv:
        yield srv
    assert srv.leftovers() == []


def finished_by_instance(srv: TritonServer) -> dict[str, float]:
    """vllm:request_success_total of model llm summed per `instance` label."""
    totals: dict[str, float] = {}
    for line in urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode().splitlines():
        m = SAMPLE.match(line)
        if m and m["name"] == "vllm:request_success_total":
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
            if labels.get("model") == "llm":
                totals[labels["instance"]] = totals.get(labels["instance"], 0) + float(m["value"])
    return totals


def run(srv: TritonServer, n: int, concurrency: int, max_tokens: int = 24) -> dict[str, float]:
    """n greedy streamed requests, `concurrency` at a time (one stream per client); then the growth of each
    instance's finished count, once the exporters (every 200 ms) have published it."""
    before = finished_by_instance(srv)
    ids = iter(range(n))
    lock = threading.Lock()
    errors: list[str] = []

    def client_loop() -> None:
        client = StreamClient(srv.grpc_url)
        try:
            while True:
                with lock:
                    i = next(ids, None)
                if i is None:
                    return
                client.send("llm", f"r{i}", f"Request {i}: count to ten.",
                            {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True})
                assert client.wait_finals(120, ids=[f"r{i}"])
                if client.records[f"r{i}"].error:
                    errors.append(client.records[f"r{i}"].error)
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    deadline = time.monotonic() + 10
    while True:
        after = finished_by_instance(srv)
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if sum(grown.values()) >= n or time.monotonic() > deadline:
            return grown


def test_both_instances_take_work_under_concurrency(server):
    grown = run(server, n=16, concurrency=8)
    print(f"16 requests, 8 at a time: {grown}")
    assert set(grown) == set(INSTANCES), grown
    assert sum(grown.values()) == 16 and min(grown.values()) > 0, grown


def test_one_request_at_a_time_also_reaches_both_instances(server):
    grown = run(server, n=8, concurrency=1)
    print(f"8 requests, one at a time: {grown}")
    assert sum(grown.values()) == 8 and min(grown.values()) > 0, grown


def test_each_cpu_instance_gets_its_share_of_the_cores(server):
    cores = len(os.sched_getaffinity(0))
    want = max(1, cores // 2)
    log = server.log_text()
    for name in INSTANCES:
        assert f"{name}: {want} torch threads" in log, f"no thread count logged for {name}"
