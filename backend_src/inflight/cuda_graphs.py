"""Decode steps through fixed-address input buffers padded to a bucket size, so CUDA graphs can replay them.

The same padded forward runs eagerly where nothing was captured (CPU, enforce_eager, a bucket without a
graph), which is how the CPU tests check it against the unpadded path.
"""
from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from .attention import AttentionMetadata
from .sequence import Sequence

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below max_num_seqs, then max_num_seqs itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None when none does."""
    i = bisect.bisect_left(buckets, num_seqs)
    return buckets[i] if i < len(buckets) else None


class StaticDecode:
    """Static buffers for steps whose every row computes one token (decodes, 1-token chunks).

    Padded rows (past the step's real rows, up to the bucket) have slot -1, so the store skips them, and
    seq_len 1 over their stale-but-valid block table, so every attention kernel sees one readable key and
    none divides by an empty softmax. max_seq_len is pinned to max_model_len: the Triton wrapper picks its
    split-KV launch shape from it, and a replayed graph must not depend on this step's lengths.
    """

    def __init__(self, forward: Callable, kv_caches, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.forward_fn = forward
        self.kv_caches = kv_caches
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.pin = device.type == "cuda"
        n = self.buckets[-1]
        self.max_blocks = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        # Zeros at first; afterwards rows hold earlier steps' tables: always valid block ids.
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        return len(scheduled) <= self.buckets[-1] and all(n == 1 for _, n in scheduled)

    def _meta(self, bucket: int, seq_lens_host: list[int]) -> AttentionMetadata:
        # seq_lens_host is read by the torch reference only (eager); the Triton path uses device tensors.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], cu_seqlens_q=self.cu_seqlens_q[:bucket + 1],
            query_lens=[1] * bucket, seq_lens_host=seq_lens_host, max_query_len=1, max_seq_len=self.max_model_len)

    def _host(self, values, dtype: torch.dtype) -> torch.Tensor:
        # Pinned host memory lets the copy below run asynchronously (the caching host allocator keeps
        # the page alive until the copy is done).
        return torch.tensor(values, dtype=dtype, pin_memory=self.pin)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Fill the static buffers; returns (ids, positions, meta, sample_idx, sample_seqs) like
        ModelRunner.prepare, with ids/positions/meta padded to the bucket."""
        num = len(scheduled)
        bucket = bucket_for(num, self.buckets)
        pad = bucket - num
        ids, pos, slots, lens, tables, sample_idx, sample_seqs = [], [], [], [], [], [], []
        bs = self.block_size
        for i, (seq, _) in enumerate(scheduled):
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(seq.block_table)
            if p + 1 == len(seq):
                sample_idx.append(i)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks is out of range: allowed at most {self.max_blocks}"
                             f" (max_model_len={self.max_model_len})")
        nb = self.pin  # asynchronous only from pinned memory
        self.input_ids[:bucket].copy_(self._host(ids + [0] * pad, torch.int64), non_blocking=nb)
        self.positions[:bucket].copy_(self._host(pos + [0] * pad, torch.int64), non_blocking=nb)
        self.slot_mapping[:bucket].copy_(self._host(slots + [-1] * pad, torch.int64), non_blocking=nb)
        self.seq_lens[:bucket].copy_(self._host(lens + [1] * pad, torch.int32), non_blocking=nb)
        # Only the real rows' tables, only as wide as this step needs: columns past a row's own blocks
        # are never read for keys (kernels stop at seq_len), so stale entries there are harmless.
        rows = self._host([t + [0] * (width - len(t)) for t in tables], torch.int32)
        self.block_tables[:num, :width].copy_(rows, non_blocking=nb)
        meta = self._meta(bucket, lens + [1] * pad)
        return self.input_ids[:bucket], self.positions[:bucket], meta, sample_idx, sample_seqs

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches=None) -> torch.Tensor:
        """Hidden states [bucket, hidden]: a graph replay when this bucket was captured, else eager."""
        bucket = ids.shape[0]
        graph = self.graphs.get(bucket)
        if graph is None:
            return self.forward_fn(ids, positions, meta, self.kv_caches)
        graph.replay()
        return self.hidden[:bucket]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so the smaller ones fit in its memory pool."""
        self.slot_mapping.fill_(-1)  # capture runs must not write the cache
        self.seq_lens.fill_(1)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            meta = self._meta(bucket, [1] * bucket)
            ids, pos = self.input_ids[:bucket], self.positions[:bucket]
            # An eager run first compiles the Triton kernels and warms cuBLAS outside the capture.
            self.hidden[:bucket] = self.forward_fn(ids, pos, meta, self.kv_caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:bucket] = self.forward_fn(ids, pos, meta, self.kv_caches)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", self.buckets)
