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


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, first_block: int, length: int) -> torch.Tensor:
    """Cached tokens first_block * block_size .. length - 1 of one sequence: [tokens, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[first_block:num_blocks].long())
    return blocks.reshape((num_blocks - first_block) * block_size, *cache.shape[2:])[:length - first_block * block_size]


def first_block_in_window(first_query_pos: int, window: int, block_size: int) -> int:
    """The first block that holds a key a query at first_query_pos (or later) can see; 0 without a window."""
    return max(0, first_query_pos - window + 1) // block_size if window else 0


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, skip_decodes: bool = False, window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context.

    query: [tokens, q_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]. The queries of
    sequence i are its last query_lens[i] positions, so query j sees keys 0 .. seq_len - query_len + j; with a
    sliding window only the last `window` of those (HF's rule: key > query - window), and blocks wholly before
    every query's window are never read. skip_decodes leaves the rows of single-token queries unwritten
    (attention/cpu.py fills them its own way).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    starts, decode_rows = step_layout(meta)
    if decode_rows and not skip_decodes:
        _decode_batch(query, k_cache, v_cache, meta, scale, decode_rows, starts, group, out, window)

    for i, q_len in enumerate(meta.query_lens):
        if q_len == 1:
            continue
        ctx_len = meta.seq_lens_host[i]
        s, e = starts[i], starts[i + 1]
        first = first_block_in_window(ctx_len - q_len, window, block_size)
        k = _gather_context(k_cache, meta.block_tables[i], first, ctx_len)
        v = _gather_context(v_cache, meta.block_tables[i], first, ctx_len)
        q = query[s:e].transpose(0, 1)  # [heads, q_len, d]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        # enable_gqa lets SDPA broadcast each K/V head over its query group instead of copying it.
        if ctx_len == q_len and not window:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)[:, None]
            k_pos = torch.arange(first * block_size, ctx_len, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if window:
                mask &= k_pos > q_pos - window
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


def _decode_plan(meta: AttentionMetadata, rows: list[int], starts: list[int], block_size: int, device,
                 window: int = 0):
    """Index tensors for the decode rows, built on the first layer (of each window size) and reused by the others.
    With a window each row reads from the first block its window touches: the gathered width is the longest
    window's blocks, not the longest context's."""
    key = ("decode", window)
    plan = meta.reference_plan.get(key)
    if plan is not None:
        return plan
    lens = [meta.seq_lens_host[i] for i in rows]
    firsts = [first_block_in_window(n - 1, window, block_size) for n in lens]
    spans = [(n + block_size - 1) // block_size - f for n, f in zip(lens, firsts)]
    max_blocks = max(spans)
    width = max_blocks * block_size
    idx = torch.tensor(rows, device=device)
    # Row r's table entries first_r .. first_r + max_blocks - 1 (clamped to the table: past a row's own span
    # they are padding, masked below).
    cols = torch.tensor(firsts, device=device)[:, None] + torch.arange(max_blocks, device=device)[None, :]
    cols = cols.clamp_(max=meta.block_tables.shape[1] - 1)
    tables = meta.block_tables.index_select(0, idx).long().gather(1, cols).reshape(-1)  # [n * max_blocks]
    token_idx = torch.tensor([starts[i] for i in rows], device=device)
    pos = torch.tensor(firsts, device=device)[:, None] * block_size + torch.arange(width, device=device)[None, :]
    lens_t = torch.tensor(lens, device=device)[:, None]
    valid = pos < lens_t
    if window:
        valid &= pos > lens_t - 1 - window
    # Flat positions of the padding, so only those are zeroed (most rows pad less than one block).
    pad_idx = (~valid).reshape(-1).nonzero().squeeze(1)
    plan = (tables, token_idx, valid[:, None, None, :], pad_idx, width)
    meta.reference_plan[key] = plan
    return plan


def _decode_batch(query, k_cache, v_cache, meta, scale, rows, starts, group, out, window: int = 0) -> None:
    """All single-token queries at once: contexts padded to the longest, padding masked out."""
    tables, token_idx, mask, pad_idx, width = _decode_plan(meta, rows, starts, k_cache.shape[1], query.device,
                                                           window)
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
