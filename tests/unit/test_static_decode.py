"""The CUDA runner's pieces that CPU can check: decode buckets, KV sizing arithmetic, and the padded
static-buffer decode (what CUDA graphs replay) run eagerly against the normal unpadded path."""
from __future__ import annotations

import os

import pytest
import torch

from engine_helpers import TINY, assert_pool_whole
from inflight import LLM, SamplingParams
from inflight.cuda_graphs import bucket_for, decode_buckets
from inflight.kv_sizing import kv_blocks_for_fraction, warmup_query_lens

GiB = 2**30
# The Triton interpreter turns loop bounds loaded from memory into ints via a 1-element array (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_decode_buckets_are_powers_of_two_then_max_num_seqs():
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_bucket_for_picks_the_smallest_that_holds_the_batch():
    buckets = decode_buckets(48)  # [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 33, 48)] == [1, 2, 4, 8, 8, 16, 48, 48]
    assert bucket_for(49, buckets) is None


def test_kv_blocks_for_fraction_arithmetic():
    # 80 GiB x 0.9 = 72 GiB; minus 2 GiB peak and 1 GiB outside torch = 69 GiB of 2 MiB blocks.
    assert kv_blocks_for_fraction(80 * GiB, 2 * GiB, 1 * GiB, 0.9, 2 * 2**20) == 69 * 512
    # Rounds down to whole blocks.
    assert kv_blocks_for_fraction(10_000, 1_000, 0, 0.5, 3_000) == 1
    assert kv_blocks_for_fraction(10_000, 1_000, 0, 1.0, 3_000) == 3


def test_kv_blocks_for_fraction_refuses_when_no_block_fits():
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 .* not one KV block"):
        kv_blocks_for_fraction(10 * GiB, 4 * GiB, 1 * GiB, 0.5, 2**20)


def test_warmup_splits_the_token_budget_into_prompts_of_at_most_max_model_len():
    assert warmup_query_lens(512, 2048) == [512]
    assert warmup_query_lens(5000, 2048) == [2048, 2048, 904]


# ---- padded static decode vs the normal path --------------------------------------------------------
PROMPTS = [list(range(5 + 7 * i, 20 + 11 * i)) for i in range(5)]  # 15 .. 59 tokens
MAX_TOKENS = [4, 6, 5, 3, 7]  # finishing at different steps: batches of 5, 4, 3, 2, 1 need padding to 8, 4, 2


def _run(static: bool):
    llm = LLM(TINY, num_kv_blocks=64, block_size=8, max_num_seqs=8, max_model_len=128)
    runner = llm.engine.runner
    logits = []
    padded = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits.append(compute_logits(h)) or logits[-1]
    if static:
        runner.enable_static_decode(capture=False)
        prepare = runner.static_decode.prepare

        def recording_prepare(scheduled):
            out = prepare(scheduled)
            padded.append((len(scheduled), out[0].shape[0]))
            return out
        runner.static_decode.prepare = recording_prepare
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_pool_whole(llm.engine)
    return [o.token_ids for o in outs], logits, padded


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_static_decode_equals_normal_path(backend, monkeypatch):
    if backend == "triton":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU check of the Triton path needs the interpreter (tests/conftest.py sets it without a GPU)")
        # The CUDA configuration on CPU: Triton attention and the fused norm / activation kernels, set as
        # an operator would (the environment overrides the options _run builds its engine with).
        monkeypatch.setenv("INFLIGHT_ATTENTION", "triton")
        monkeypatch.setenv("INFLIGHT_FUSED_OPS", "1")
    want_ids, want_logits, _ = _run(static=False)
    got_ids, got_logits, padded = _run(static=True)
    assert got_ids == want_ids
    assert {(n, b) for n, b in padded} >= {(5, 8), (3, 4), (1, 1)}, f"padding not exercised: {padded}"
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits):
        # Different batch shapes may pick different matmul blockings: equal up to fp32 rounding.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
