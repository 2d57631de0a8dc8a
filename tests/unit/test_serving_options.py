"""config.pbtxt parameters -> EngineConfig + serving options (backend_src/serving/options.py)."""
from pathlib import Path

import pytest

from engine_helpers import MODEL_REPOSITORY, ROOT, TINY
from serving.options import flatten_triton_parameters, parse_model_parameters

ROOT_PATH = Path(ROOT)
REPO = MODEL_REPOSITORY  # relative model paths resolve against the model repository


def test_defaults_point_at_smollm2_beside_the_model_repository():
    opts = parse_model_parameters({}, REPO)
    assert opts.engine.model == str(REPO / ".." / "models" / "SmolLM2-135M-Instruct")
    assert opts.engine.default_max_tokens != 16
    assert opts.cancel_check_period_s == 0.1 and opts.engine.max_prompt_bytes == 1 << 20


def test_every_kind_of_parameter_lands_where_it_belongs():
    opts = parse_model_parameters({
        "model": "../models/tiny-llama", "dtype": "float32", "device": "cpu", "block_size": "8",
        "num_kv_blocks": "32", "kv_cache_memory_bytes": "1048576", "max_num_seqs": "4",
        "max_num_batched_tokens": "64", "max_model_len": "128", "enable_prefix_caching": "false",
        "enable_chunked_prefill": "true", "fast_lane_share": "0.5", "max_queue_size": "3",
        "default_max_tokens": "20", "cancel_check_period_ms": "250", "metrics_interval_ms": "500",
        "max_prompt_bytes": "1000", "max_stop_words": "4", "max_json_bytes": "2048"}, REPO)
    e = opts.engine
    assert Path(e.model).resolve() == Path(TINY).resolve()
    assert e.block_size == 8 and e.num_kv_blocks == 32 and e.max_num_seqs == 4
    assert e.enable_prefix_caching is False and e.fast_lane_share == 0.5 and e.default_max_tokens == 20
    assert opts.cancel_check_period_s == 0.25 and opts.metrics_interval_s == 0.5
    assert (opts.engine.max_prompt_bytes, opts.limits.max_stop_words, opts.limits.max_json_bytes) == (1000, 4, 2048)


def test_blank_values_mean_default():
    assert parse_model_parameters({"max_num_seqs": " "}, REPO).engine.max_num_seqs == 64


@pytest.mark.parametrize("params,needles", [
    ({"max_num_sequences": "4"}, ["max_num_sequences", "max_num_seqs"]),
    ({"block_size": "sixteen"}, ["block_size", "'sixteen'"]),
    ({"enable_prefix_caching": "maybe"}, ["enable_prefix_caching", "'maybe'"]),
    ({"dtype": "int8"}, ["dtype", "'int8'"]),
    ({"cancel_check_period_ms": "0"}, ["cancel_check_period_ms=0", "[1, 60000]"]),
    ({"max_prompt_bytes": "-5"}, ["max_prompt_bytes=-5"]),
    ({"model": "models/nope"}, ["model='models/nope'", "config.json"]),
])
def test_unknown_or_malformed_parameters_fail_with_their_names(params, needles):
    with pytest.raises(ValueError) as info:
        parse_model_parameters(params, REPO)
    for needle in needles:
        assert needle in str(info.value)


def test_an_absolute_model_path_does_not_depend_on_the_repository(tmp_path):
    opts = parse_model_parameters({"model": str(ROOT_PATH / "models" / "tiny-llama")}, tmp_path)
    assert opts.engine.model == TINY


def test_flatten_triton_parameters():
    cfg = {"parameters": {"model": {"string_value": "x"}, "block_size": {"string_value": "8"}}}
    assert flatten_triton_parameters(cfg) == {"model": "x", "block_size": "8"}
    assert flatten_triton_parameters({}) == {}
