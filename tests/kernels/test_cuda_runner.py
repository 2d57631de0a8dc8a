"""The CUDA model runner on a real GPU (skipped elsewhere): CUDA-graph decodes equal eager ones, bf16 by
default, KV cache sized from gpu_memory_utilization. The CPU halves of these checks are in
tests/unit/test_static_decode.py."""
from __future__ import annotations

import os

import pytest
import torch

from inflight import LLM, SamplingParams

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tiny-llama")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="needs CUDA with compiled Triton kernels"),
    pytest.mark.skipif(not os.path.exists(os.path.join(TINY, "config.json")),
                       reason="models/tiny-llama missing (carry it to the GPU host)"),
]
PROMPTS = [list(range(5 + 7 * i, 20 + 11 * i)) for i in range(5)]
MAX_TOKENS = [4, 6, 5, 3, 7]  # batches of 5, 4, 3, 2, 1: padded to buckets 8, 4, 4, 2, 1


def _generate(**options):
    llm = LLM(TINY, device="cuda", block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=256, **options)
    runner = llm.engine.runner
    logits, replays = [], []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logits.append(compute_logits(h).cpu()) or logits[-1]
    if runner.static_decode is not None:
        forward = runner.static_decode.forward

        def counting_forward(ids, *args):
            replays.append(ids.shape[0] in runner.static_decode.graphs)
            return forward(ids, *args)
        runner.static_decode.forward = counting_forward
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm, [o.token_ids for o in outs], logits, replays


def test_graph_replay_equals_eager_fp32():
    llm, got_ids, got_logits, replays = _generate(dtype="float32")
    assert sorted(llm.engine.runner.static_decode.graphs) == [1, 2, 4, 8]
    assert replays and all(replays), "decode steps did not replay graphs"
    _, want_ids, want_logits, _ = _generate(dtype="float32", enforce_eager=True)
    assert got_ids == want_ids
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bf16_default_and_kv_sized_from_memory_fraction():
    fraction = 0.02  # a few GiB: tiny-llama blocks are 4 KiB, and each is a Python object in the block manager
    llm = LLM(TINY, device="cuda", max_num_seqs=8, max_model_len=256, gpu_memory_utilization=fraction)
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16 and runner.num_blocks > 0
    total = torch.cuda.mem_get_info()[1]
    assert runner.num_blocks * runner.bytes_per_block() <= fraction * total
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-gemma3"])
def test_other_families_on_cuda_equal_hf_past_the_window(family):
    """Qwen3 and Gemma 3 (window 24) through the Triton kernels and CUDA graphs, fp32: greedy equals HF."""
    from engine_helpers import hf_greedy  # tests/ is on pytest's pythonpath (pyproject.toml)

    path = os.path.join(os.path.dirname(TINY), family)
    llm = LLM(path, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=8,
              max_model_len=256, max_num_batched_tokens=32)
    prompts = [list(range(100, 100 + n)) for n in (3, 30, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, p, 20)
