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
    seq_len 1 over an all-zero block table row, so every attention kernel sees one readable key and none
    divides by an empty softmax. max_seq_len is pinned to max_model_len: the Triton wrapper picks its
    split-KV launch shape from it, and a replayed graph must not depend on this step's lengths.

    Host side, a step costs one short Python pass over its rows and two copies to the device: the inputs
    are written into persistent (pinned, on CUDA) staging buffers, and block tables are kept per sequence
    in a host table that only receives each sequence's new block ids (see _table_rows). The staging buffers
    are reused only once the previous step's copies out of them are done (an event; the engine reads every
    step's sampled tokens, so they always are, unless a step sampled nothing).
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
        self.max_blocks = mb = (max_model_len + block_size - 1) // block_size
        # Device inputs. int64: ids, positions, slot mapping; int32: seq lens, then block tables [n, mb],
        # in one flat buffer each so a step is two copies. Views of them are what graphs are captured on.
        self._dev64 = torch.zeros((3, n), dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(n + n * mb, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64
        self.seq_lens = self._dev32[:n]
        self.block_tables = self._dev32[n:].view(n, mb)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Host staging, laid out as the device buffers.
        self._host64 = torch.zeros((3, n), dtype=torch.int64, pin_memory=self.pin)
        self._host32 = torch.zeros(n + n * mb, dtype=torch.int32, pin_memory=self.pin)
        self._np64, self._np32 = self._host64.numpy(), self._host32.numpy()
        self._host_tables = self._host32[n:].view(n, mb)
        # Block tables by table slot (one per running sequence, plus an all-zero row for padding).
        self._tables = torch.zeros((n + 1, mb), dtype=torch.int32)
        self._tables_np = self._tables.numpy()
        self._pad_slot = n
        self._slot_of: dict[Sequence, int] = {}
        self._slot_table: list[list[int] | None] = [None] * n  # the block_table list written into each slot
        self._slot_len = [0] * n  # how many of its ids are written
        self._slot_last = [-1] * n  # the last id written: a block replaced in place (copy-on-write) shows here
        self._free_slots = list(range(n - 1, -1, -1))
        self._copied = torch.cuda.Event() if self.pin else None  # recorded after each step's copies

    def fits(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        return len(scheduled) <= self.buckets[-1] and all(n == 1 for _, n in scheduled)

    def _meta(self, bucket: int, seq_lens_host: list[int]) -> AttentionMetadata:
        # seq_lens_host is read by the torch reference only (eager); the Triton path uses device tensors.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], cu_seqlens_q=self.cu_seqlens_q[:bucket + 1],
            query_lens=[1] * bucket, seq_lens_host=seq_lens_host, max_query_len=1, max_seq_len=self.max_model_len)

    def _table_rows(self, seqs: list[Sequence]) -> list[int]:
        """The table slot of each sequence, after writing the block ids its slot lacks.

        A sequence keeps its slot from step to step, so a decode step writes nothing for most rows and one id
        for a row that just crossed into a new block. A new block_table list (the sequence was preempted and
        re-admitted) or a changed last id (a block replaced in place) rewrites the row. Slots of sequences
        absent from the step are reclaimed when slots run out.
        """
        slot_of, slot_table, slot_len, slot_last = self._slot_of, self._slot_table, self._slot_len, self._slot_last
        rows = []
        for seq in seqs:
            table = seq.block_table
            slot = slot_of.get(seq)
            if slot is None:
                if not self._free_slots:
                    self._reclaim_slots(seqs)
                slot = slot_of[seq] = self._free_slots.pop()
                slot_table[slot] = None
            written, num = slot_len[slot], len(table)
            if slot_table[slot] is not table or written > num or (written and table[written - 1] != slot_last[slot]):
                slot_table[slot], written = table, 0
            if num != written:
                if num > self.max_blocks:
                    raise ValueError(f"a block table of {num} blocks is out of range: allowed at most "
                                     f"{self.max_blocks} (max_model_len={self.max_model_len})")
                self._tables_np[slot, written:num] = table[written:]
                slot_len[slot], slot_last[slot] = num, table[-1]
            rows.append(slot)
        return rows

    def _reclaim_slots(self, live: list[Sequence]) -> None:
        keep = set(live)
        for seq in [s for s in self._slot_of if s not in keep]:
            slot = self._slot_of.pop(seq)
            self._slot_table[slot], self._slot_len[slot] = None, 0
            self._free_slots.append(slot)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Fill the static buffers; returns (ids, positions, meta, sample_idx, sample_seqs) like
        ModelRunner.prepare, with ids/positions/meta padded to the bucket."""
        num = len(scheduled)
        bucket = bucket_for(num, self.buckets)
        n = self.buckets[-1]
        bs = self.block_size
        seqs = [seq for seq, _ in scheduled]
        pos = [seq.num_computed_tokens for seq in seqs]
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the last step's copies still read the staging buffers
        h64, h32 = self._np64, self._np32
        h64[0, :num] = [seq.token_ids[p] for seq, p in zip(seqs, pos)]
        h64[1, :num] = pos
        h64[2, :num] = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, pos)]
        h64[:, num:bucket] = ((0,), (0,), (-1,))
        lens = [p + 1 for p in pos] + [1] * (bucket - num)
        h32[:bucket] = lens
        rows = self._table_rows(seqs) + [self._pad_slot] * (bucket - num)
        torch.index_select(self._tables, 0, torch.tensor(rows), out=self._host_tables[:bucket])
        nb = self.pin  # asynchronous only from pinned memory
        self._dev64[:, :bucket].copy_(self._host64[:, :bucket], non_blocking=nb)
        end = n + bucket * self.max_blocks  # seq lens (all n) and the bucket's table rows
        self._dev32[:end].copy_(self._host32[:end], non_blocking=nb)
        if self._copied is not None:
            self._copied.record()
        sample_idx = [i for i, (seq, p) in enumerate(zip(seqs, pos)) if p + 1 == len(seq.token_ids)]
        sample_seqs = [seqs[i] for i in sample_idx]
        return self.input_ids[:bucket], self.positions[:bucket], self._meta(bucket, lens), sample_idx, sample_seqs

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
