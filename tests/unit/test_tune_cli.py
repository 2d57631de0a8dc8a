"""The tuner end to end without a server: the cost fit, calibration on the tiny model, trace -> search (config
written, summary.json with its keys, report) and the prefix report; plus the config writer's guarantees."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_helpers import MODEL_REPOSITORY, TINY
from serving.options import parse_model_parameters
from tuner import cli, config_writer
from tuner.cost import FEATURES, CostModel, Fit, fit

SUMMARY_KEYS = {"chosen", "sla", "predicted", "measured", "default_measured"}


def _cost_json(path: Path, coef: dict) -> Path:
    """A hand-made cost.json (what calibrate writes, minus the points)."""
    data = {"form": "", "features": list(FEATURES), "dtype": "float32", "code_version": "test",
            "host": {"hostname": "test", "cpu": "test cpu", "cpus": 2, "torch": "", "cpu_gemm": "onednn",
                     "default_threads": 2},
            "model": {"name": "tiny-llama", "path": TINY, "kv_bytes_per_token": 46080},  # SmolLM2's
            "fits": {"1": {"coef_ms": coef, "stats": {}}, "2": {"coef_ms": {k: v * 0.7 for k, v in coef.items()},
                                                                "stats": {}}}}
    path.write_text(json.dumps(data))
    return path


COEF = {"step": 20.0, "tokens": 0.4, "sampled": 0.5, "prefill_chunks": 0.5, "prefill_attn": 0.02,
        "decode_ctx": 0.0, "decode_pad": 0.05}


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    points = []
    for _ in range(60):
        x = [1.0, *rng.uniform(0, 500, 1), *rng.uniform(0, 64, 1), *rng.integers(0, 4, 1), *rng.uniform(0, 300, 3)]
        points.append({"features": x, "step_ms": sum(COEF[k] * v for k, v in zip(FEATURES, x))})
    f = fit(points)
    for k in COEF:
        assert f.coef_ms[k] == pytest.approx(COEF[k], abs=1e-6)
    assert f.coef_ms["decode_spill"] == pytest.approx(0, abs=1e-6)
    assert f.stats["max_abs_rel_err"] < 1e-9 and f.stats["cv_max_abs_rel_err"] < 1e-9


def test_fit_finds_where_decode_attention_spills_out_of_cache():
    rng = np.random.default_rng(2)
    truth = Fit({**COEF, "decode_spill": 3.0}, knee=16.0)
    points = []
    for _ in range(80):
        x = [1.0, *rng.uniform(0, 500, 1), *rng.uniform(0, 64, 1), *rng.integers(0, 4, 1), *rng.uniform(0, 40, 3)]
        points.append({"features": x, "step_ms": truth.predict_ms(x)})
    f = fit(points)
    assert f.knee == 16.0 and f.coef_ms["decode_spill"] == pytest.approx(3.0, rel=1e-6)
    assert CostModel({"model": {"kv_bytes_per_token": 1}, "fits": {"1": {"coef_ms": f.coef_ms, "knee": f.knee}}}
                     ).step_seconds(1)([]) == pytest.approx(COEF["step"] / 1e3)


def test_calibrate_on_the_tiny_model_writes_a_usable_cost_model(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tuner", "calibrate", "--out", str(tmp_path),
                           "--model", TINY, "--threads", "1", "--reps", "1", "--quick", "--retries", "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    cost = CostModel.load(tmp_path / "cost.json")
    assert cost.threads == [1] and cost.data["model"]["name"] == "tiny-llama"
    assert cost.data["host"]["cpus"] and cost.data["code_version"] and cost.data["dtype"] == "float32"
    points = cost.data["fits"]["1"]["points"]
    assert {p["rows"] for p in points} >= {0, 1, 8, 32} and all(p["step_ms"] > 0 for p in points)
    assert cost.step_seconds(1)([]) > 0  # the per-step floor
    assert SUMMARY_KEYS <= set(json.loads((tmp_path / "summary.json").read_text()))
    assert (tmp_path / "cost.md").exists() and (tmp_path / "cost_fit.png").exists()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A model repository holding only llm/config.pbtxt (what search reads and writes next to)."""
    (tmp_path / "repo" / "llm").mkdir(parents=True)
    shutil.copy(MODEL_REPOSITORY / "llm" / "config.pbtxt", tmp_path / "repo" / "llm" / "config.pbtxt")
    return tmp_path / "repo"


def test_search_writes_a_config_a_summary_and_a_report(tmp_path, repo):
    cost = _cost_json(tmp_path / "cost.json", COEF)
    trace = tmp_path / "trace.jsonl"
    assert cli.main(["trace", "--mix", "seed", "--rate", "3", "--requests", "120", "--scale", "0.05",
                      "--model", TINY, "--out", str(trace)]) == 0
    out = tmp_path / "search"
    assert cli.main(["search", "--cost", str(cost), "--trace", str(trace), "--ttft-p99-ms", "2000",
                      "--itl-p99-ms", "200", "--name", "slatest", "--out", str(out), "--repo", str(repo),
                      "--workers", "1", "--grid", "max_num_seqs=2,8", "--grid", "max_num_batched_tokens=32,256",
                      "--grid", "fast_lane_share=0.25", "--grid", "block_size=16"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    for key in ("output_tok_s", "ttft_p99_ms", "itl_p99_ms"):
        assert summary["predicted"][key] > 0
    assert summary["sla"]["ttft_p99_ms"] == 2000 and summary["sla"]["rate"] > 2
    assert summary["search"]["configs"] == 9  # 2 threads x 2 x 2, and the default config
    chosen = summary["chosen"]
    assert set(chosen) >= {"threads", "max_num_seqs", "max_num_batched_tokens", "block_size"}
    assert summary["predicted"]["ttft_p99_ms"] <= 2000 and summary["predicted"]["itl_p99_ms"] <= 200
    assert summary["max_rate"]["rate"] >= summary["sla"]["rate"]
    written = (repo / "llm" / "configs" / "slatest.pbtxt").read_text()
    source = (repo / "llm" / "config.pbtxt").read_text()
    changed = config_writer.differences(source, written)
    assert set(changed) <= set(chosen) - {"threads"}
    assert f"OMP_NUM_THREADS={chosen['threads']}" in written
    assert (out / "report.md").exists() and (out / "pareto.png").exists() and (out / "configs.csv").exists()


def test_prefix_report_recommends_caching_for_shared_system_prompts(tmp_path):
    trace = tmp_path / "chat.jsonl"
    assert cli.main(["trace", "--mix", "chat", "--rate", "1", "--requests", "40", "--model", TINY,
                      "--out", str(trace)]) == 0
    out = tmp_path / "prefixes"
    assert cli.main(["prefixes", str(trace), "--out", str(out), "--model", TINY, "--block-sizes", "8,16,64",
                      "--pools-mib", "0.05,64", "--pool-mib", "64"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["chosen"]["enable_prefix_caching"] is True
    assert summary["predicted"]["prefix_hit_rate"] > 0.5  # 3 system prompts of ~400 tokens among 40 requests
    rates = {(r["block_size"], r["pool_mib"]): r["hit_rate"] for r in summary["table"]}
    assert rates[(8, 64)] >= rates[(64, 64)]  # smaller blocks never lose hits at the ragged end
    assert rates[(16, 0.05)] < rates[(16, 64)]  # a pool too small to keep the prefixes loses them


def test_config_writer_changes_only_parameter_values():
    source = (MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    text = config_writer.render(source, {"max_num_seqs": 12, "block_size": 32, "threads": 1}, "header")
    assert config_writer.differences(source, text) == {"max_num_seqs": ("64", "12"), "block_size": ("16", "32")}
    with pytest.raises(KeyError, match="max_num_sequences"):
        config_writer.render(source, {"max_num_sequences": 4}, "")
    with pytest.raises(ValueError, match="outside parameter values"):
        config_writer.differences(source, text.replace('max_batch_size: 0', 'max_batch_size: 4'))


@pytest.mark.parametrize("path", config_writer.tuned_configs(MODEL_REPOSITORY), ids=lambda p: p.stem)
def test_committed_tuned_configs_follow_llm_config(path):
    """A tuned config must stay llm/config.pbtxt with other parameter values: run `python -m tuner refresh-configs`
    when llm's inputs, outputs or comments change."""
    source = (MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    config_writer.differences(source, path.read_text())
    params = config_writer.engine_parameters(path.read_text())
    params["model"] = TINY
    parse_model_parameters(params, MODEL_REPOSITORY)  # every value is a valid engine option


def test_refresh_keeps_values_and_header_when_llm_config_changes(repo):
    path = config_writer.write(repo, "mine", {"max_num_seqs": 12, "threads": 1},
                               "Tuned by python -m tuner test\nline 2")
    assert not config_writer.refresh(repo, path)  # nothing to do
    source = repo / "llm" / "config.pbtxt"
    source.write_text(source.read_text().replace("max_batch_size: 0", "# a new comment\nmax_batch_size: 0"))
    assert config_writer.refresh(repo, path)
    text = path.read_text()
    assert config_writer.differences(source.read_text(), text) == {"max_num_seqs": ("64", "12")}
    assert text.startswith("# Tuned by python -m tuner test\n# line 2\n") and "# a new comment" in text


def test_configs_tuned_before_the_package_are_still_found(repo):
    """Configs written by the old perf/tune.py carry its name in their header; refresh-configs must still see them."""
    new = config_writer.write(repo, "new", {"max_num_seqs": 12}, "Tuned by python -m tuner search")
    old = config_writer.write(repo, "old", {"max_num_seqs": 8}, "Tuned by perf/tune.py search")
    config_writer.write(repo, "hand", {"max_num_seqs": 4}, "written by hand")
    assert config_writer.tuned_configs(repo) == [new, old]


def test_server_scale_records_the_verified_step_factor_per_thread_count_and_scales_every_step(tmp_path):
    cost_path = _cost_json(tmp_path / "cost.json", COEF)
    runs = []
    for name, used, ratios in (("a", {"chosen": 1.0, "default": 1.0}, {"chosen": 0.9, "default": 1.2}),
                               ("b", {"chosen": 1.0, "default": 1.1}, {"chosen": 1.0, "default": 1.2})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(
            {"verification": {"server_step_scale_used": used, "step_time_ratio": ratios,
                              "threads": {"chosen": 1, "default": 2}}}))
        runs.append(str(tmp_path / name))
    assert cli.main(["server-scale", "--cost", str(cost_path), *runs]) == 0
    cost = CostModel.load(cost_path)
    # ratios to the engine alone: 1 thread 0.9 and 1.0; 2 threads 1.2 and 1.2 x 1.1
    assert cost.server_scale_for(1) == pytest.approx(0.95, abs=1e-3)
    assert cost.server_scale_for(2) == pytest.approx((1.2 + 1.32) / 2, abs=1e-3)
    one_row = [(type("Seq", (), {"num_computed_tokens": 10, "token_ids": list(range(11))})(), 1)]
    for threads in (1, 2):
        engine = cost.step_seconds(threads, scale=1.0)(one_row)
        assert cost.step_seconds(threads)(one_row) == pytest.approx(cost.server_scale_for(threads) * engine)
