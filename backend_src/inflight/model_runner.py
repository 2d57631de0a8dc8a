"""Translates scheduled sequences into one flat token batch, runs the model, returns the rows to sample."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .cpu_defaults import resolve_cpu_defaults
from .cpu_threads import ThreadGovernor, load_at_one_thread
from .cuda_graphs import StaticDecode
from .kv_sizing import SizingLock, measure_kv_blocks
from .model import ModelConfig, load_model
from .model import cpu_forward, native_decode
from .model.fused_forward import fused_forward
from .model.linear import release_dense_weights
from .model.quant import attach_quant_product, quantized_bytes
from .sequence import Sequence
from .step_timer import NULL_TIMER

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _return_freed_memory() -> None:
    """glibc keeps heap memory freed at load (the checkpoint's tensors, float32 weights a quantized load dropped)
    for reuse; trimming gives it back, so the process's RSS says what the model holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def resolve_dtype(config: EngineConfig) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if str(config.device).startswith("cuda") else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.is_cuda = self.device.type == "cuda"
        self.dtype = resolve_dtype(config)
        # On CPU, bfloat16 is a weight format: the weights in bf16 (half of float32's bytes, which is what a CPU
        # step waits on), widened exactly by the native product; activations and the KV cache stay float32.
        self.weight_format = config.quantization
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            self.dtype, self.weight_format = torch.float32, "bf16"
        self.model_config = ModelConfig.from_path(config.model)
        self.timer = NULL_TIMER  # a StepTimer while a benchmark measures phases (engine.set_step_timer)
        self.static_decode: StaticDecode | None = None
        # Every "auto" switch resolved here, once, for this CPU and device; passed down from here on.
        self.switches = resolve_cpu_defaults(config)
        log.info("engine switches: %s", self.switches.summary(self.device.type))
        # On CPU the stepping thread alone runs OpenMP teams: loading runs at one thread, and the first step sets
        # the thread count chosen here (by the operator or the instance placement). See cpu_threads.py.
        self.governor = None
        if self.device.type == "cpu":
            width = load_at_one_thread(torch.get_num_threads, torch.set_num_threads)
            self.governor = ThreadGovernor(width, len(os.sched_getaffinity(0)), torch.set_num_threads,
                                           adaptive=self.switches.cpu_thread_governor)
        # Sized from device memory, the pool is measured against what this engine uses, so loading, sizing and
        # allocating (graphs included) wait for any other engine on this host doing the same (kv_sizing.py).
        sizing = SizingLock(self.device) if self.is_cuda and not config.num_kv_blocks else contextlib.nullcontext()
        with sizing:
            self.model = load_model(config.model, self.dtype, self.device, self.switches, self.weight_format)
            _return_freed_memory()
            self.model.set_attention_backend(self.switches.attention_backend)
            self.forward = self._pick_forward()
            self.num_blocks = config.num_kv_blocks or (
                self._blocks_from_gpu_memory(sizing.used_before) if self.is_cuda
                else self._blocks_from_memory_budget())
            self.kv_caches = self._allocate_kv_caches(self.num_blocks)
            if self.is_cuda and not config.enforce_eager:
                if self.switches.attention_backend == "triton":
                    self.enable_static_decode(capture=True)
                else:  # the torch reference reads host-side lengths each step: a replay would reuse stale ones
                    log.info("no CUDA graphs: attention_backend=torch selects the torch reference attention")
        log.info("model %s: %d layers, KV cache %d blocks of %d tokens (%s, %s)", config.model,
                 self.model_config.num_layers, self.num_blocks, config.block_size, self.dtype, self.device)

    def set_attention_backend(self, backend: str) -> None:
        """Switch the loaded model's attention (auto, triton, torch), e.g. to compare the two on one engine. CUDA
        graphs captured with the other backend are not recaptured: compare with enforce_eager."""
        self.model.set_attention_backend(backend)

    def _pick_forward(self):
        if self.model.is_quantized:
            return self._quantized_forward()
        if not self.model.uses_fast_paths:
            # The fused CUDA ops, the compiled CPU layer and the native decode step are written for llama.py's
            # layer without a window; another family runs its own torch forward (model/<family>.py).
            cfg = self.model_config
            log.info("model_type %s (family %s%s): the torch forward; fused_ops, cpu_compile and "
                     "cpu_native_decode cover the Llama family without a sliding window", cfg.model_type,
                     cfg.family, ", sliding window %d" % cfg.sliding_window if cfg.sliding_window else "")
            if not native_decode.native_few_row_linears(self.model, self.device, self.dtype, self.switches) \
                    and self.device.type == "cpu":
                release_dense_weights(self.model)
            return self.model
        if self.switches.fused_ops:
            return functools.partial(fused_forward, self.model)
        if self.device.type == "cpu" and self.switches.cpu_compile:
            return cpu_forward.CompiledCPUForward(self.model)
        forward = native_decode.native_forward(self.model, self.device, self.dtype, self.switches)
        if forward is None and self.device.type == "cpu":
            release_dense_weights(self.model)  # kept for the native step, where Linear does not take BLAS (AMD)
        return forward or self.model

    def _quantized_forward(self):
        """A quantized model: its linears through the native product, and decode-only steps through the whole
        native step where the family is Llama's; the torch forward otherwise."""
        if not attach_quant_product(self.model):
            log.warning("quantized linears: the native product did not build, so every call dequantizes its "
                        "weight (slow); install a C compiler (cc)")
            return self.model
        log.info("quantized model (%s): %.0f MB of quantized weights", self.weight_format,
                 quantized_bytes(self.model) / 2**20)
        if self.model.uses_fast_paths and self.switches.cpu_native_decode:
            forward = native_decode.native_forward(self.model, self.device, self.dtype, self.switches)
            if forward is not None:
                return forward
        return self.model

    def enable_static_decode(self, capture: bool) -> None:
        """Route all-one-token steps through padded static buffers (cuda_graphs.py); capture=True (CUDA)
        records a graph per batch-size bucket. Without capture the padded path runs eagerly, on any device."""
        c = self.config
        self.static_decode = StaticDecode(
            self.forward, self.kv_caches, max_num_seqs=c.max_num_seqs, max_model_len=c.max_model_len,
            block_size=c.block_size, hidden_size=self.model_config.hidden_size, dtype=self.dtype, device=self.device)
        if capture:
            self.static_decode.capture()

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

    def _blocks_from_gpu_memory(self, used_before: int) -> int:
        def make_kv_caches(num_blocks: int):
            k, v = self._new_kv_tensors(num_blocks)
            return list(zip(k, v)), 2 * k.numel() * k.element_size()

        cfg = self.config
        return measure_kv_blocks(self.forward, self.model.compute_logits, make_kv_caches,
                                 cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs, cfg.block_size,
                                 self.bytes_per_block(), cfg.gpu_memory_utilization, self.device, used_before)

    def _new_kv_tensors(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches in the [layers, blocks, block_size, kv_heads, head_dim] layout, zeroed."""
        c = self.model_config
        shape = (c.num_layers, num_blocks, self.config.block_size, c.num_kv_heads, c.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer a K and a V tensor [blocks, block_size, kv_heads, head_dim], sliced from the whole."""
        self.k_cache, self.v_cache = self._new_kv_tensors(num_blocks)
        return list(zip(self.k_cache, self.v_cache))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV blocks (source, destination), every layer: copy-on-write of blocks that forked samples shared."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in (self.k_cache, self.v_cache):  # [layers, blocks, block_size, kv_heads, head_dim]
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """Flat inputs for the batch, and the indices of the tokens whose logits are needed."""
        input_ids, positions, slots, sample_idx, sample_seqs = [], [], [], [], []
        query_lens, seq_lens = [], []
        bs = self.config.block_size
        tables = []
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            padded = table + [0] * (max_blocks - len(table))
            if seq.spec_token_ids:
                self._verification_rows(seq, num_new, padded, input_ids, positions, slots, query_lens, seq_lens,
                                        tables, sample_idx, sample_seqs)
                continue
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            tables.append(padded)
            if end == len(seq):  # the chunk reaches the newest token: this row samples
                sample_idx.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        h2d = self._to_device
        meta = AttentionMetadata(
            slot_mapping=h2d(slots, torch.int64),
            block_tables=h2d(tables, torch.int32),
            seq_lens=h2d(seq_lens, torch.int32),
            cu_seqlens_q=h2d(cu, torch.int32),
            query_lens=query_lens, seq_lens_host=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        )
        ids = h2d(input_ids, torch.int64)
        pos = h2d(positions, torch.int64)
        return ids, pos, meta, sample_idx, sample_seqs

    def _verification_rows(self, seq: Sequence, num_new: int, table: list[int], input_ids, positions, slots,
                           query_lens, seq_lens, tables, sample_idx, sample_seqs) -> None:
        """A sequence's newest token and its drafts (speculation/), one decode row each: row j holds position
        start + j and attends to the first start + j + 1 positions of the shared block table. Every layer stores
        the step's K/V before it attends, so row j sees the drafts before it, as a causal chunk would; as decode
        rows they keep the decode-only forwards (the native CPU step among them), whose per-row results do not
        depend on what shares the step. Every row samples: row j's logits verify draft j + 1."""
        bs = self.config.block_size
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start:] + seq.spec_token_ids
        assert len(tokens) == num_new, f"{seq}: {num_new} tokens scheduled, {len(tokens)} to verify"
        for j, token in enumerate(tokens):
            pos = start + j
            input_ids.append(token)
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            query_lens.append(1)
            seq_lens.append(pos + 1)
            tables.append(table)
            sample_idx.append(len(input_ids) - 1)
            sample_seqs.append(seq)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        if not self.is_cuda:
            return torch.tensor(values, dtype=dtype, device=self.device)
        # From pinned memory the copy is asynchronous: the CPU goes on building the step while it runs.
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]):
        """Run one forward; returns (logits [rows, vocab] float32, the sequences those rows belong to)."""
        if self.governor is not None:
            self.governor.before_step()
        static = self.static_decode
        if static is not None and static.fits(scheduled):
            prepare, forward = static.prepare, static.forward
        else:
            prepare, forward = self.prepare, self.forward
        ids, pos, meta, sample_idx, sample_seqs = prepare(scheduled)
        self.timer.lap("prepare")
        hidden = forward(ids, pos, meta, self.kv_caches)
        logits = None
        if sample_seqs:
            if sample_idx[-1] == len(sample_idx) - 1:  # rows 0..n-1 (decodes, padded or not): no gather
                rows = hidden[:len(sample_idx)]
            else:
                rows = hidden.index_select(0, self._to_device(sample_idx, torch.int64))
            logits = self.model.compute_logits(rows)
        self.timer.lap("forward")
        if self.governor is not None:
            self.governor.after_step()
        return logits, sample_seqs
