"""Paged attention in plain torch: the CPU path and the oracle that the GPU kernels are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, plan: dict | None = None) -> None:
    """Write each new token's K/V ([tokens, kv_heads, head_dim]) into its cache slot; slot -1 is skipped.
    plan: the step's AttentionMetadata.reference_plan, to share per-step work across layers."""
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    valid = _valid_slots(slot_mapping, plan)
    if valid is None:
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[valid]
        flat_k.index_copy_(0, slots, key[valid])
        flat_v.index_copy_(0, slots, value[valid])


def _valid_slots(slot_mapping: torch.Tensor, plan: dict | None) -> torch.Tensor | None:
    """None when every token has a slot, else the mask of those that do; once per step when a plan is given
    (the all() is a host sync, which every layer would otherwise pay)."""
    if plan is not None and "valid_slots" in plan:
        return plan["valid_slots"]
    valid = slot_mapping >= 0
    valid = None if bool(valid.all()) else valid
    if plan is not None:
        plan["valid_slots"] = valid
    return valid


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, skip_decodes: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    query: [tokens, q_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]. The queries of
    sequence i are its last query_lens[i] positions, so query j sees keys 0 .. seq_len - query_len + j.
    skip_decodes leaves the rows of single-token queries unwritten (attention/cpu.py fills them its own way).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts, decode_rows = step_layout(meta)
    if decode_rows and not skip_decodes:
        _decode_batch(query, k_cache, v_cache, meta, scale, decode_rows, starts, group, out)

    for i, q_len in enumerate(meta.query_lens):
        if q_len == 1:
            continue
        ctx_len = meta.seq_lens_host[i]
        s, e = starts[i], starts[i + 1]
        k = _gather_context(k_cache, meta.block_tables[i], ctx_len)
        v = _gather_context(v_cache, meta.block_tables[i], ctx_len)
        q = query[s:e].transpose(0, 1)  # [heads, q_len, d]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        # enable_gqa lets SDPA broadcast each K/V head over its query group instead of copying it.
        if ctx_len == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[s:e] = o.transpose(0, 1)
    return out


def step_layout(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(first token of each sequence in the flat batch, the decode rows): once per step, not per layer."""
    layout = meta.reference_plan.get("layout")
    if layout is None:
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        layout = meta.reference_plan["layout"] = (starts, [i for i, n in enumerate(meta.query_lens) if n == 1])
    return layout


def _decode_plan(meta: AttentionMetadata, rows: list[int], starts: list[int], block_size: int, device):
    """Index tensors for the decode rows, built on the first layer and reused by the others."""
    plan = meta.reference_plan.get("decode")
    if plan is not None:
        return plan
    lens = [meta.seq_lens_host[i] for i in rows]
    max_blocks = (max(lens) + block_size - 1) // block_size
    width = max_blocks * block_size
    idx = torch.tensor(rows, device=device)
    tables = meta.block_tables.index_select(0, idx)[:, :max_blocks].long().reshape(-1)  # [n * max_blocks]
    token_idx = torch.tensor([starts[i] for i in rows], device=device)
    lens_t = torch.tensor(lens, device=device)
    valid = torch.arange(width, device=device)[None, :] < lens_t[:, None]  # [n, width]
    # Flat positions of the padding, so only those are zeroed (most rows pad less than one block).
    pad_idx = (~valid).reshape(-1).nonzero().squeeze(1)
    plan = (tables, token_idx, valid[:, None, None, :], pad_idx, width)
    meta.reference_plan["decode"] = plan
    return plan


def _decode_batch(query, k_cache, v_cache, meta, scale, rows, starts, group, out) -> None:
    """All single-token queries at once: contexts padded to the longest, padding masked out."""
    tables, token_idx, mask, pad_idx, width = _decode_plan(meta, rows, starts, k_cache.shape[1], query.device)
    n = len(rows)
    # index_select on the flat table: several times faster on CPU than advanced indexing k_cache[tables].
    k = k_cache.index_select(0, tables).reshape(n, width, *k_cache.shape[2:])  # [n, L, kv_heads, d]
    v = v_cache.index_select(0, tables).reshape(n, width, *v_cache.shape[2:])
    # Padded slots may hold anything (NaN in a never-written block): a 0 weight times NaN is NaN, so zero
    # them. The gather made a fresh tensor, so the cache itself is untouched.
    if pad_idx.numel():
        v.view(n * width, *v.shape[2:]).index_fill_(0, pad_idx, 0.0)
    q = query.index_select(0, token_idx).unsqueeze(2)  # [n, heads, 1, d]
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
                                       enable_gqa=group > 1)
    out.index_copy_(0, token_idx, o.squeeze(2))
