"""Paged attention in plain torch: the CPU path and the oracle that the GPU kernels are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([tokens, kv_heads, head_dim]) into its cache slot; slot -1 is skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    valid = slot_mapping >= 0
    if bool(valid.all()):
        flat_k.index_copy_(0, slot_mapping, key)
        flat_v.index_copy_(0, slot_mapping, value)
    else:
        slots = slot_mapping[valid]
        flat_k.index_copy_(0, slots, key[valid])
        flat_v.index_copy_(0, slots, value[valid])


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole cached context.

    query: [tokens, q_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]. The queries of
    sequence i are its last query_lens[i] positions, so query j sees keys 0 .. seq_len - query_len + j.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
    starts = [0]
    for n in meta.query_lens:
        starts.append(starts[-1] + n)

    if decode_rows:
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


def _decode_batch(query, k_cache, v_cache, meta, scale, rows, starts, group, out) -> None:
    """All single-token queries at once: contexts padded to the longest, padding masked out."""
    block_size = k_cache.shape[1]
    lens = [meta.seq_lens_host[i] for i in rows]
    max_len = max(lens)
    max_blocks = (max_len + block_size - 1) // block_size
    idx = torch.tensor(rows, device=query.device)
    tables = meta.block_tables.index_select(0, idx)[:, :max_blocks].long()  # [n, max_blocks]
    n = len(rows)
    k = k_cache[tables].reshape(n, max_blocks * block_size, *k_cache.shape[2:])  # [n, L, kvh, d]
    v = v_cache[tables].reshape(n, max_blocks * block_size, *v_cache.shape[2:])
    k = k.transpose(1, 2)  # [n, kv_heads, L, d]
    v = v.transpose(1, 2)
    token_idx = torch.tensor([starts[i] for i in rows], device=query.device)
    q = query.index_select(0, token_idx).unsqueeze(2)  # [n, heads, 1, d]
    lens_t = torch.tensor(lens, device=query.device)
    mask = torch.arange(max_blocks * block_size, device=query.device)[None, :] < lens_t[:, None]
    # Padded slots may hold anything (NaN in a never-written block): a 0 weight times NaN is NaN, so zero them.
    v = v.masked_fill(~mask[:, None, :, None], 0.0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=group > 1)
    out.index_copy_(0, token_idx, o.squeeze(2))
