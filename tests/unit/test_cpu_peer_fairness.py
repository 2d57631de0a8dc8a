"""perf.peers.cpu_peer measures its sides fairly: the c16 rounds and single streams rotate which side goes first
(the c16 load used to run our side first, always), and a side's memory is every process under its root, summed
(it used to count our `llm` stub alone against the whole llama-server). No servers: a client that answers at once
stands in for each, and the memory is this test's own processes."""
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

from perf.ab.workloads import Request, Workload
from perf.peers import side_memory
from perf.peers.cpu_peer import Side, kv_pool_llama, kv_pool_ours, round_orders, run_sides
from perf.peers.side_memory import ProcessMemory
from perf.peers.stream_clients import Result


def test_two_sides_take_turns_at_going_first():
    assert round_orders(["ours", "llama_cpp"], 4) == [["ours", "llama_cpp"], ["llama_cpp", "ours"],
                                                      ["ours", "llama_cpp"], ["llama_cpp", "ours"]]


def test_three_sides_each_go_first_second_and_last_once_in_three_rounds():
    orders = round_orders(["ours", "ours_int8", "llama_cpp"], 3)
    for position in range(3):
        assert sorted(order[position] for order in orders) == ["llama_cpp", "ours", "ours_int8"]


class AnswersAtOnce:
    """Stands in for a server: every token at once, each call written down (side, max_tokens, prompt)."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls, self.lock = name, calls, threading.Lock()

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = True) -> Result:
        with self.lock:
            self.calls.append((self.name, max_tokens, prompt))
        res = Result(time.perf_counter())
        res.arrivals = [(time.perf_counter(), 1) for _ in range(max_tokens)]
        return res


def workload(tag: str, n: int = 4) -> Workload:
    return Workload("mixed", "", [Request(f"{tag} {i}", 2) for i in range(n)], 8, 0)


def test_run_sides_rotates_the_c16_rounds_and_the_single_streams():
    calls: list = []
    sides = [Side(name, name, AnswersAtOnce(name, calls), os.getpid()) for name in ("ours", "llama_cpp")]
    args = SimpleNamespace(concurrency=2, single_repeats=4, single_tokens=7)
    result = run_sides(sides, [workload("round0"), workload("round1")], workload("warm"), args)

    def first_seen(calls_of_a_kind) -> list[str]:
        return list(dict.fromkeys(side for side, _, _ in calls_of_a_kind))
    assert first_seen(c for c in calls if c[2].startswith("round0")) == ["ours", "llama_cpp"]
    assert first_seen(c for c in calls if c[2].startswith("round1")) == ["llama_cpp", "ours"]
    singles = [side for side, max_tokens, _ in calls if max_tokens == 7]
    assert singles == ["ours", "llama_cpp", "llama_cpp", "ours", "ours", "llama_cpp", "llama_cpp", "ours"]
    for name in ("ours", "llama_cpp"):
        assert result[name]["requests"] == 8 and result[name]["output_tokens"] == 16
        assert len(result[name]["rounds_output_tok_s"]) == 2 and len(result[name]["single_ms_per_token_runs"]) == 4


def test_a_side_is_its_root_and_everything_below_it():
    parent_of = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert side_memory.descendants(10, parent_of) == [10, 11, 12, 13]
    assert side_memory.descendants(21, parent_of) == [21]


def test_side_memory_sums_every_process_and_a_missing_pss_spoils_the_pss_sum():
    procs = [ProcessMemory(10, "tritonserver", 300.0, 120.0), ProcessMemory(11, "stub llm_0_0", 900.25, 850.5)]
    both = side_memory.side_memory(procs)
    assert (both["rss_mb"], both["pss_mb"]) == (1200.2, 970.5)
    assert [p["name"] for p in both["processes"]] == ["tritonserver", "stub llm_0_0"]
    partial = side_memory.side_memory(procs + [ProcessMemory(12, "stub llm_0_1", 50.0, None)])
    assert (partial["rss_mb"], partial["pss_mb"]) == (1250.2, None)


def test_measuring_a_live_side_counts_its_child_too():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while True:  # until the child holds its 64 MB
            mine = side_memory.measure_side(os.getpid())
            by_pid = {p["pid"]: p for p in mine["processes"]}
            if child.pid in by_pid and by_pid[child.pid]["rss_mb"] > 60 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert child.pid in by_pid and by_pid[child.pid]["rss_mb"] > 60, mine
        assert mine["processes"][0]["pid"] == os.getpid()
        assert abs(mine["rss_mb"] - sum(p["rss_mb"] for p in mine["processes"])) < 0.1 * len(by_pid)
        assert mine["rss_mb"] > by_pid[os.getpid()]["rss_mb"] + 60
        assert [p["pid"] for p in side_memory.measure_side(child.pid)["processes"]] == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_kv_pools_are_read_from_each_servers_own_log():
    ours = kv_pool_ours("2026-12-07 00:02:06,212 inflight.model_runner INFO model /m/SmolLM2-135M-Instruct: 30 "
                        "layers, KV cache 728 blocks of 16 tokens (torch.float32, cpu)", 2 * 30 * 3 * 64)
    assert ours == {"blocks": 728, "block_size": 16, "tokens": 11648, "dtype": "float32", "mib": 511.9}
    theirs = kv_pool_llama("0.00.482.276 I srv    load_model: initializing, n_slots = 16, n_ctx_slot = 512, "
                           "kv_unified = 'false'\n", 8192, 16, 2 * 30 * 3 * 64)
    assert theirs == {"ctx_tokens": 8192, "slots": 16, "cache_type": "f16", "ctx_per_slot": 512, "kv_unified": False,
                      "mib": 180.0}
