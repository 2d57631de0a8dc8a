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
