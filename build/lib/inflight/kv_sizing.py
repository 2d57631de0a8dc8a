"""KV cache size on CUDA: what a share of the device's memory leaves after weights and a warm-up forward.

gpu_memory_utilization is this engine's share of the *whole* device (total memory, not what is free): its
weights, activations and KV cache together stay under fraction x total (the CUDA graphs' small pool comes on
top, from the rest). Two engines on one
device (the `llm` and `llm_dynamic` models) need shares that add up to at most what the device can give,
e.g. 0.45 each; an engine whose share does not fit in the memory left free fails to load, naming the numbers.

Engines in other processes on the same host load in parallel (Triton loads models concurrently, one stub
process each), and each sizes its pool from the memory it sees free; SizingLock serialises loading, sizing
and allocating, so each engine measures after the previous one has taken its pool.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from typing import Callable

import torch

from .attention import AttentionMetadata

log = logging.getLogger(__name__)


class SizingLock:
    """Held from before the model loads until the KV pool and CUDA graphs are allocated: an exclusive lock on
    a file shared by every engine process on this host, and the device memory in use when it was taken (other
    processes', and this one's CUDA context), which is not this engine's to count."""

    PATH = os.path.join(tempfile.gettempdir(), "inflight-kv-sizing.lock")

    def __init__(self, device: torch.device):
        self.device = device
        self.used_before = 0

    def __enter__(self) -> "SizingLock":
        self._file = open(self.PATH, "a")  # held until __exit__
        fcntl.flock(self._file, fcntl.LOCK_EX)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.used_before = total - free
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def kv_blocks_for_fraction(total_bytes: int, peak_bytes: int, non_torch_bytes: int, fraction: float,
                           bytes_per_block: int, free_bytes: int | None = None) -> int:
    """Blocks that fit in fraction x total once the measured peak and this engine's memory outside torch
    are paid.

    peak_bytes: the most torch ever held at once (weights + the warm-up forward's activations);
    non_torch_bytes: device memory this engine uses outside torch's allocator (cuBLAS workspaces, ...);
    free_bytes: device memory free now, weights loaded (None: not checked), which the pool and the activations
    still to come must fit in. Raises when not one block fits, or the share does not fit in what is free,
    naming the numbers.
    """
    budget = int(total_bytes * fraction) - peak_bytes - non_torch_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"gpu_memory_utilization={fraction} of {total_bytes / 2**30:.2f} GiB leaves "
            f"{budget / 2**30:.3f} GiB after a peak of {peak_bytes / 2**30:.2f} GiB and "
            f"{non_torch_bytes / 2**30:.2f} GiB outside torch: not one KV block of {bytes_per_block} bytes; "
            f"allowed: a larger fraction, fewer max_num_batched_tokens, or num_kv_blocks > 0")
    num = budget // bytes_per_block
    if free_bytes is not None and num * bytes_per_block > free_bytes:
        raise ValueError(
            f"gpu_memory_utilization={fraction} of {total_bytes / 2**30:.2f} GiB asks for a KV cache of "
            f"{num * bytes_per_block / 2**30:.2f} GiB, but {free_bytes / 2**30:.2f} GiB of the device is free "
            f"(other engines or processes hold the rest): allowed shares that add up to at most what the device "
            f"holds, e.g. 0.45 for each of two engines, or num_kv_blocks > 0")
    return num


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
                      bytes_per_block: int, fraction: float, device: torch.device, used_before: int = 0) -> int:
    """Warm up, measure, and size the KV cache for gpu_memory_utilization = fraction.

    used_before: device memory in use before this engine loaded anything (SizingLock.used_before).
    """
    peak = profile_peak_bytes(forward, compute_logits, make_kv_caches, num_tokens, max_model_len, max_num_seqs,
                              block_size, device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    ours = (total - free) - used_before  # everything this engine holds now: weights, workspaces, caches
    non_torch = max(0, ours - torch.cuda.memory_reserved(device))
    # The pool must fit in what is free beside the activations a peak step adds to what is allocated now.
    available = free - max(0, peak - torch.cuda.memory_allocated(device))
    num = kv_blocks_for_fraction(total, peak, non_torch, fraction, bytes_per_block, available)
    log.info("KV sizing: %.2f GiB total x %.2f, peak %.2f GiB, outside torch %.2f GiB, in use before %.2f GiB "
             "-> %d blocks (%.2f GiB)", total / 2**30, fraction, peak / 2**30, non_torch / 2**30,
             used_before / 2**30, num, num * bytes_per_block / 2**30)
    return num
