"""KV cache size on CUDA: what a share of the device's memory leaves after weights and a warm-up forward."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from .attention import AttentionMetadata

log = logging.getLogger(__name__)


def kv_blocks_for_fraction(total_bytes: int, peak_bytes: int, non_torch_bytes: int, fraction: float,
                           bytes_per_block: int) -> int:
    """Blocks that fit in fraction x total once the measured peak and the memory outside torch are paid.

    peak_bytes: the most torch ever held at once (weights + the warm-up forward's activations);
    non_torch_bytes: device memory in use that torch's allocator does not hold (CUDA context, cuBLAS
    workspaces, other processes). Raises when not one block fits, naming the numbers.
    """
    budget = int(total_bytes * fraction) - peak_bytes - non_torch_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"gpu_memory_utilization={fraction} of {total_bytes / 2**30:.2f} GiB leaves "
            f"{budget / 2**30:.3f} GiB after a peak of {peak_bytes / 2**30:.2f} GiB and "
            f"{non_torch_bytes / 2**30:.2f} GiB outside torch: not one KV block of {bytes_per_block} bytes; "
            f"allowed: a larger fraction, fewer max_num_batched_tokens, or num_kv_blocks > 0")
    return budget // bytes_per_block


def warmup_query_lens(num_tokens: int, max_model_len: int) -> list[int]:
    """max_num_batched_tokens split into prompts no longer than max_model_len (the largest prefill step)."""
    lens = []
    while num_tokens > 0:
        lens.append(min(num_tokens, max_model_len))
        num_tokens -= lens[-1]
    return lens


@torch.inference_mode()
def profile_peak_bytes(forward: Callable, compute_logits: Callable, make_kv_caches: Callable, num_tokens: int,
                       max_model_len: int, max_num_seqs: int, block_size: int, device: torch.device) -> int:
    """Peak bytes torch holds during one forward of num_tokens prefill tokens plus the logits of up to
    max_num_seqs rows, not counting the small KV cache the warm-up itself needs.

    make_kv_caches(num_blocks) returns (per-layer caches, their bytes).
    """
    q_lens = warmup_query_lens(num_tokens, max_model_len)
    tables, slots, next_block = [], [], 0
    for n in q_lens:
        blocks = list(range(next_block, next_block + (n + block_size - 1) // block_size))
        next_block += len(blocks)
        tables.append(blocks)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
    max_blocks = max(len(t) for t in tables)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    kv_caches, kv_bytes = make_kv_caches(next_block)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32,
                                  device=device),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        query_lens=q_lens, seq_lens_host=q_lens, max_query_len=max(q_lens), max_seq_len=max(q_lens))
    # Token ids 0 and positions of real prompts: the activations' sizes are what matters here.
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in q_lens])
    hidden = forward(ids, pos, meta, kv_caches)
    rows = min(max_num_seqs, num_tokens)
    # The sampler's working copies of the logits (probabilities, a sorted copy for top-p) are alike in size.
    logits = compute_logits(hidden[:rows])
    torch.softmax(logits, dim=-1).sort(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - kv_bytes
    del kv_caches, hidden, logits, meta
    return peak


def measure_kv_blocks(forward: Callable, compute_logits: Callable, make_kv_caches: Callable,
                      num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                      bytes_per_block: int, fraction: float, device: torch.device) -> int:
    """Warm up, measure, and size the KV cache for gpu_memory_utilization = fraction."""
    peak = profile_peak_bytes(forward, compute_logits, make_kv_caches, num_tokens, max_model_len, max_num_seqs,
                              block_size, device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    num = kv_blocks_for_fraction(total, peak, non_torch, fraction, bytes_per_block)
    log.info("KV sizing: %.2f GiB total x %.2f, peak %.2f GiB, outside torch %.2f GiB -> %d blocks (%.2f GiB)",
             total / 2**30, fraction, peak / 2**30, non_torch / 2**30, num, num * bytes_per_block / 2**30)
    return num
