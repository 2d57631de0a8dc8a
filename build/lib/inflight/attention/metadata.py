"""Per-step attention metadata for one flat token batch (prefill chunks and decodes mixed, no padding)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    # An upper bound of seq_lens: it sets the Triton split-KV launch shape. A CUDA-graph decode passes
    # max_model_len, so a replay never depends on the lengths of the step it was captured in.
    max_seq_len: int
    # Host-side helpers the torch reference derives once per step and shares across all layers.
    reference_plan: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
