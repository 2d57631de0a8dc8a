"""A tuned config (llm/configs/<name>.pbtxt, written by `python -m tuner search`) loads in the real tritonserver
under --model-config-name and serves; the verify replayer measures what it streams (tiny-llama, loopback)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from engine_helpers import MODEL_REPOSITORY, TINY
from server_harness.quiescence import scrape
from server_harness.repository import copy_model
from tuner import config_writer
from tuner.sim import kv_blocks
from tuner.verify import replay, server_figures

TUNED = {"max_num_seqs": 6, "max_num_batched_tokens": 48, "fast_lane_share": 0.5, "block_size": 32,
         "kv_cache_memory_bytes": 8 << 20, "threads": 1}


def _committed_or_fresh(repo: Path) -> Path:
    """The project's committed tuned config if there is one (its model pointed at tiny-llama, the one value the
    test changes), else one written now by the tuner's writer."""
    committed = config_writer.tuned_configs(MODEL_REPOSITORY)
    configs = repo / "llm" / "configs"
    if committed:
        source = committed[0]
        text = config_writer.render(source.read_text(), {"model": TINY}, "copy for the load test")
        (configs / source.name).write_text(text)
        return configs / source.name
    return config_writer.write(repo, "slatest", {**TUNED, "model": TINY}, "written by the load test")


def test_a_tuned_config_loads_and_serves(tmp_path, triton_server_factory):
    repo = tmp_path / "repo"
    copy_model(MODEL_REPOSITORY, "llm", repo, params={"model": TINY})
    shutil.rmtree(repo / "llm" / "configs", ignore_errors=True)
    (repo / "llm" / "configs").mkdir()
    path = _committed_or_fresh(repo)
    server = triton_server_factory(repo, [f"--model-config-name={path.stem}"], env={"OMP_NUM_THREADS": "1"})
    sends = [(0.0, "The capital of France is", 5, 0), (0.05, "Once upon a time", 3, 0), (0.1, "1, 2, 3,", 4, -1)]
    figures = replay(server.grpc_url, sends, drain_s=60)
    assert figures["requests_done"] == 3 and figures["errors"] == 0
    assert figures["output_tokens"] == 12  # ignore_eos: exactly max_tokens each
    assert 0 < figures["ttft_p50_ms"] < 30_000 and figures["itl_p99_ms"] > 0
    # The engine really runs with the tuned values: its pool is the one the tuned config asks for.
    params = config_writer.engine_parameters(path.read_text())
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    kv_bytes_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
        cfg["hidden_size"] // cfg["num_attention_heads"]) * 4
    expected = kv_blocks({k: int(params[k]) for k in ("num_kv_blocks", "block_size", "kv_cache_memory_bytes")},
                         kv_bytes_per_token)
    deadline = time.monotonic() + 10
    while True:  # gauges are exported once a second
        m = scrape(server.metrics_url, "llm")
        pool = m.get("inflight:kv_blocks_free", 0) + m.get("inflight:kv_blocks_used", 0)
        if pool == expected and server_figures(server.metrics_url)["steps"] >= 3:
            break
        assert time.monotonic() < deadline, f"pool {m} is not the tuned config's {expected} blocks"
        time.sleep(0.2)
