"""CPU paged attention for the compiled CPU forward: one opaque op per layer, decodes without a K/V copy.

The compiled forward (model/cpu_forward.py) runs one inductor graph per decoder layer, the same graph for
every layer; attention is the one part that depends on host-side, per-step metadata (which rows decode, each
sequence's context length and blocks), so it is a custom op the graph calls with (q, k, v) and that reads the
rest, the next layer's caches included, from the step context set around the forward. Decode rows attend
straight from the paged cache through a small compiled kernel whose loads follow the block table (inductor
fuses the indexing into the dot products and the weighted sum, so no per-sequence copy of K/V is made);
prefill chunks, which are compute-bound, keep the reference's SDPA path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import reference
from .metadata import AttentionMetadata


@dataclass
class StepContext:
    """What the attention op needs beyond its tensor arguments, for one forward."""
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # Layers run in order and call the op once each, so the n-th call of a step is layer n. Counting here
    # rather than passing the index keeps the index out of the graph, which would otherwise compile per layer.
    next_layer: int = 0


# The one deliberate piece of global state: the step being run by this process's engine thread. Set only by
# step_context() around a forward; the op refuses to run without it.
_current: StepContext | None = None


@contextlib.contextmanager
def step_context(meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
    global _current
    if _current is not None:
        raise RuntimeError("a CPU forward is already running: one engine thread per process")
    _current = StepContext(meta, kv_caches)
    try:
        yield _current
    finally:
        _current = None


def decode_attention(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, slots: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, d]; k_flat, v_flat [cache slots, kv_heads, d]; slots [n, width] (each row's cache slots
    in order, any valid slot past its length); lens [n]. Written so that inductor fuses the slot loads into
    the reductions: no [n, width, kv_heads, d] copy is ever made."""
    n, num_heads, d = q.shape
    num_kv_heads = k_flat.shape[1]
    qg = q.view(n, 1, num_kv_heads, num_heads // num_kv_heads, d)
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < lens[:, None]  # [n, width]
    k = k_flat[slots]  # [n, width, kv_heads, d]
    scores = (qg * k[:, :, :, None, :]).sum(-1) * scale  # [n, width, kv_heads, group]
    scores = scores.masked_fill(~valid[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    # A padded slot may hold anything; where() keeps a NaN there from reaching the sum (0 * NaN is NaN).
    v = torch.where(valid[:, :, None, None], v_flat[slots], 0.0)
    out = (probs[..., None] * v[:, :, :, None, :]).sum(1)  # [n, kv_heads, group, d]
    return out.reshape(n, num_heads, d)


_compiled_decode = None


def _decode_kernel():
    global _compiled_decode
    if _compiled_decode is None:
        _compiled_decode = torch.compile(decode_attention, dynamic=True, fullgraph=True)
    return _compiled_decode


def _decode_plan(meta: AttentionMetadata, rows: list[int], starts: list[int], block_size: int, device):
    """Each decode row's cache slots in order, its length and its token: built by the first layer, shared."""
    plan = meta.reference_plan.get("cpu_decode")
    if plan is None:
        lens = [meta.seq_lens_host[i] for i in rows]
        num_blocks = (max(lens) + block_size - 1) // block_size
        tables = meta.block_tables.index_select(0, torch.tensor(rows, device=device))[:, :num_blocks].long()
        offsets = torch.arange(block_size, device=device)
        slots = (tables[:, :, None] * block_size + offsets).reshape(len(rows), num_blocks * block_size)
        token_idx = torch.tensor([starts[i] for i in rows], device=device)
        plan = meta.reference_plan["cpu_decode"] = (slots, torch.tensor(lens, device=device), token_idx)
    return plan


@torch.library.custom_op("inflight::cpu_attention", mutates_args=())
def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Store the next layer's K/V of this step in its cache, then attend; q [tokens, heads, d], k/v [tokens,
    kv_heads, d].

    Declared without mutation on purpose: the caches are not graph values (they come from the step context),
    and nothing else in the graph reads them, so the compiler has nothing to order around.
    """
    ctx = _current
    if ctx is None:
        raise RuntimeError("inflight::cpu_attention runs only inside attention.cpu.step_context()")
    meta = ctx.meta
    k_cache, v_cache = ctx.kv_caches[ctx.next_layer]
    ctx.next_layer += 1
    reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.reference_plan)
    starts, rows = reference.step_layout(meta)
    num_blocks, block_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    if len(rows) == meta.num_seqs:  # decode-only step: row i is token i
        slots, lens, _ = _decode_plan(meta, rows, starts, block_size, q.device)
        return _decode_kernel()(q, k_flat, v_flat, slots, lens, scale)
    out = reference.paged_attention(q, k_cache, v_cache, meta, scale, skip_decodes=True)
    if rows:  # decodes beside prefill chunks
        slots, lens, token_idx = _decode_plan(meta, rows, starts, block_size, q.device)
        out.index_copy_(0, token_idx, _decode_kernel()(q.index_select(0, token_idx), k_flat, v_flat, slots, lens,
                                                       scale))
    return out


@cpu_attention.register_fake
def _(q, k, v, scale):
    return torch.empty_like(q)
