"""Translates scheduled sequences into one flat token batch, runs the model, returns the rows to sample."""
from __future__ import annotations

import logging

import torch

from .attention import AttentionMetadata
from .block_manager import BlockManager
from .config import EngineConfig
from .model import ModelConfig, load_model
from .sequence import Sequence

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if str(config.device).startswith("cuda") else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config)
        self.model_config = ModelConfig.from_dir(config.model)
        self.model = load_model(config.model, self.dtype, self.device)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory_budget()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        log.info("model %s: %d layers, KV cache %d blocks of %d tokens (%s, %s)", config.model,
                 self.model_config.num_layers, self.num_blocks, config.block_size, self.dtype, self.device)

    def bytes_per_block(self) -> int:
        c = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * c.num_layers * self.config.block_size * c.num_kv_heads * c.head_dim * elem

    def _blocks_from_memory_budget(self) -> int:
        num = self.config.kv_cache_memory_bytes // self.bytes_per_block()
        if num < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} holds no block: "
                             f"one block needs {self.bytes_per_block()} bytes")
        return int(num)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer a K and a V tensor [blocks, block_size, kv_heads, head_dim]; together the
        [layers, blocks, block_size, kv_heads, head_dim] layout, sliced per layer."""
        c = self.model_config
        shape = (c.num_layers, num_blocks, self.config.block_size, c.num_kv_heads, c.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_cache, self.v_cache = k, v
        return [(k[i], v[i]) for i in range(c.num_layers)]

    def prepare(self, scheduled: list[tuple[Sequence, int]], bm: BlockManager):
        """Flat inputs for the batch, and the indices of the tokens whose logits are needed."""
        input_ids, positions, slots, sample_idx, sample_seqs = [], [], [], [], []
        query_lens, seq_lens = [], []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(bm.slot(seq, p) for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == len(seq):  # the chunk reaches the newest token: this row samples
                sample_idx.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in scheduled]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            query_lens=query_lens, seq_lens_host=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_idx, sample_seqs

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], bm: BlockManager):
        """Run one forward; returns (logits [rows, vocab] float32, the sequences those rows belong to)."""
        ids, pos, meta, sample_idx, sample_seqs = self.prepare(scheduled, bm)
        hidden = self.model(ids, pos, meta, self.kv_caches)
        if not sample_seqs:
            return None, []
        rows = hidden.index_select(0, torch.tensor(sample_idx, device=self.device))
        return self.model.compute_logits(rows), sample_seqs
