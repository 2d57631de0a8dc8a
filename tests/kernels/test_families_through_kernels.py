"""Qwen3 and Gemma 3 (sliding window 24) through the Triton attention kernels, end to end: greedy equals HF
generate with prompts past the window, in 32-token prefill chunks. Interpreted on CPU hosts (conftest.py),
compiled where CUDA exists."""
from __future__ import annotations

import pytest

from engine_helpers import TINY_GEMMA3, TINY_QWEN3, hf_greedy
from inflight import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize("path", [TINY_GEMMA3, TINY_QWEN3], ids=["gemma3", "qwen3"])
def test_family_greedy_through_the_kernels_equals_hf(path, device):
    llm = LLM(path, device=str(device), dtype="float32", attention_backend="triton", block_size=16,
              num_kv_blocks=32, max_num_batched_tokens=32, enforce_eager=True)
    prompts = [list(range(100, 100 + n)) for n in (3, 30, 45)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, p, 6), f"{len(p)}-token prompt diverged"
