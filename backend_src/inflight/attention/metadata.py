"""Per-step attention metadata for one flat token batch (prefill chunks and decodes mixed, no padding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Device tensors, as kernels take them.
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset); -1 skips
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0 past each table's end
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    # The same on the host, so the CPU reference never syncs or calls .item().
    query_lens: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
