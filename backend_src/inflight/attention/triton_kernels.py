"""Triton-language kernels for the paged KV cache: store, unified paged attention, split-KV decode.

Kernels are defined once, at import; set TRITON_INTERPRET=1 before importing to run them on CPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton import knobs

from .metadata import AttentionMetadata

# Decided when the @triton.jit decorators below run; changing the env var later has no effect.
INTERPRETED: bool = bool(knobs.runtime.interpret)

LOG2E = 1.4426950408889634
MIN_TILE = 16  # tl.dot on tensor cores needs every dimension >= 16
MAX_SPLITS = 32
MIN_SPLIT_LEN = 256  # a split shorter than this costs more in the reduce than it saves
NO_WINDOW = 1 << 30  # the window argument of full attention: longer than any context


# ----------------------------------------------------------------------------------------------
# store
# ----------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    block_size,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # -1: padding or a token whose KV is already cached
        blk = slot // block_size
        off = slot % block_size
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                    mask=mask)
        kc = k_cache_ptr + blk * stride_kcb + off * stride_kcs
        vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs
        tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
                 k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
                 v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# attention: shared inner loop
# ----------------------------------------------------------------------------------------------
@triton.jit
def _attend_range(
    acc, m_i, l_i, q,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    q_pos, kv_lo, kv_hi, window, qk_scale, block_size,
    offs_d, d_mask,
    TILE_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) over keys [kv_lo, kv_hi) of one sequence.

    MASKED=False is the fast path: the caller guarantees every key in the range is written and visible
    to every row, and that the range is a whole number of tiles. MASKED=True masks keys >= kv_hi (their
    slots may hold garbage or NaN, so they are never loaded), keys after each row's position q_pos and keys
    at or before q_pos - window (a sliding window; a huge window for full attention).
    """
    offs_n = tl.arange(0, TILE_N)
    kv_head = kv_head.to(tl.int64)
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + offs_n
        if MASKED:
            n_valid = pos < kv_hi
            # Entries past a table's end are padding: don't even read them.
            blk = tl.load(table_ptr + pos // block_size, mask=n_valid, other=0).to(tl.int64)
            kv_mask = n_valid[:, None] & d_mask[None, :]
        else:
            blk = tl.load(table_ptr + pos // block_size).to(tl.int64)
            kv_mask = d_mask[None, :]
        within = (pos % block_size).to(tl.int64)
        k_rows = blk * stride_kcb + within * stride_kcs + kv_head * stride_kch  # [TILE_N] int64
        v_rows = blk * stride_vcb + within * stride_vcs + kv_head * stride_vch
        # K is loaded transposed ([HEAD_DIM_PAD, TILE_N]) so q @ k needs no tl.trans.
        k = tl.load(k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_kcd, mask=tl.trans(kv_mask),
                    other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vcd, mask=kv_mask, other=0.0)

        if DOT_FP32:  # interpreter only: it multiplies bf16 wrongly
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = s * qk_scale  # log2 domain: exp2 below
        if MASKED:
            visible = n_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; exp2(-inf - -inf) would be NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # P is rounded to the cache dtype before P @ V, as tensor cores need; masked V rows are 0, not NaN.
        p = p.to(v.dtype)
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


# ----------------------------------------------------------------------------------------------
# attention: one kernel for the mixed batch
# ----------------------------------------------------------------------------------------------
@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    stride_ot, stride_oh, stride_od,
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    qk_scale, block_size, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, q_tile, kv_head): BLOCK_Q query tokens x GROUP query heads packed in BLOCK_M rows."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile_first = q_tile * BLOCK_Q
    if tile_first >= q_len:  # the grid is sized for the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_off = seq_len - q_len  # absolute position of this sequence's first query

    # Row r holds query token r // GROUP and head kv_head * GROUP + r % GROUP: the K/V tile loaded
    # once serves the whole group of query heads that share it.
    rows = tl.arange(0, BLOCK_M)
    q_local = tile_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = ctx_off + q_local
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    tok = (q_start + q_local).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :] * stride_qd, mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys between the last row's window start and the tile's first query position are visible to every
    # row: whole tiles of them go through the unmasked loop; the rest (the window's ragged start, the causal
    # diagonal) through the masked one. Keys before the first row's window are never read.
    tile_last = tl.minimum(tile_first + BLOCK_Q, q_len)  # exclusive
    kv_hi = ctx_off + tile_last
    kv_full = ((ctx_off + tile_first) // TILE_N) * TILE_N
    lo_any = (tl.maximum(ctx_off + tile_first - window + 1, 0) // TILE_N) * TILE_N
    lo_all = tl.cdiv(tl.maximum(kv_hi - window, 0), TILE_N) * TILE_N
    kv_open = tl.minimum(tl.maximum(lo_all, lo_any), kv_full)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        q_pos, lo_any, kv_open, window, qk_scale, block_size, offs_d, d_mask,
        TILE_N=TILE_N, MASKED=True, DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        q_pos, kv_open, kv_full, window, qk_scale, block_size, offs_d, d_mask,
        TILE_N=TILE_N, MASKED=False, DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        q_pos, kv_full, kv_hi, window, qk_scale, block_size, offs_d, d_mask,
        TILE_N=TILE_N, MASKED=True, DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows only; every real row sees key 0
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh
             + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------
# attention: split-KV (flash-decoding) for decode-only steps, and its reduce
# ----------------------------------------------------------------------------------------------
@triton.jit
def _split_decode_kernel(
    o_part_ptr, lse_part_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    stride_ps, stride_ph, stride_pk,  # o_part [seqs, q_heads, splits, HEAD_DIM_PAD]; lse_part drops the last
    stride_qt, stride_qh, stride_qd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    qk_scale, block_size, split_len, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): the one query token's GROUP heads over keys of one split."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    tok = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + tok * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Splits cover the keys the query sees (the last `window`, or all); split_len is a multiple of TILE_N, so
    # every split but a sequence's last is whole tiles.
    kv_lo = tl.maximum(seq_len - window, 0) + split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, seq_len)  # may be <= kv_lo: an empty split for a short sequence
    kv_full = tl.maximum(kv_lo, kv_lo + ((kv_hi - kv_lo) // TILE_N) * TILE_N)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        q_pos, kv_lo, kv_full, window, qk_scale, block_size, offs_d, d_mask,
        TILE_N=TILE_N, MASKED=False, DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
        stride_kcb, stride_kcs, stride_kch, stride_kcd, stride_vcb, stride_vcs, stride_vch, stride_vcd,
        q_pos, kv_full, kv_hi, window, qk_scale, block_size, offs_d, d_mask,
        TILE_N=TILE_N, MASKED=True, DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    # An empty split stores o = 0 and lse = -inf, so the reduce gives it weight 0 without 0 * NaN.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = seq.to(tl.int64) * stride_ps + head.to(tl.int64) * stride_ph + split * stride_pk
    tl.store(o_part_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=row_valid[:, None])
    tl.store(lse_part_ptr + part, lse, mask=row_valid)


@triton.jit
def _split_reduce_kernel(
    out_ptr, o_part_ptr, lse_part_ptr, cu_seqlens_q_ptr,
    stride_ot, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pk,
    num_splits,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Program (seq, q_head): merge the splits' partial outputs, weighted by their log-sum-exp."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_splits
    part = seq.to(tl.int64) * stride_ps + head.to(tl.int64) * stride_ph + offs_s * stride_pk
    lse = tl.load(lse_part_ptr + part, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)  # finite: split 0 always holds the first key the query sees
    w = tl.exp2(lse - lse_max)
    o = tl.load(o_part_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_ot + head.to(tl.int64) * stride_oh + offs_d * stride_od,
             res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# ----------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------
def _check_device(*tensors: torch.Tensor) -> None:
    if not INTERPRETED and not all(t.is_cuda for t in tensors):
        raise RuntimeError("Triton attention kernels need CUDA tensors; to run them on CPU set "
                           "TRITON_INTERPRET=1 before inflight.attention.triton_kernels is first imported")


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([tokens, kv_heads, head_dim]) into its cache slot; slot -1 is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_device(key, value, k_cache, v_cache, slot_mapping)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """KV splits for a decode-only step: enough programs to fill the GPU, none shorter than MIN_SPLIT_LEN."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    programs = num_seqs * num_kv_heads
    target = 2 * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_seq_len // MIN_SPLIT_LEN, MAX_SPLITS))


def triton_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, *, block_m: int | None = None,
                           tile_n: int | None = None, num_splits: int | None = None,
                           window: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached context (see reference.py); window > 0:
    each query sees only the last `window` positions, and no earlier block is read.

    Uses only host-side metadata (num_seqs, max_query_len, max_seq_len) for launch shapes: no device sync.
    block_m, tile_n and num_splits override the tuning (tests use them to force tiny tiles / splits);
    num_splits > 1 is honoured only for decode-only steps.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit query "
                         f"head_dim {head_dim}")
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=query.dtype, device=query.device)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    _check_device(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q)

    group = num_q_heads // num_kv_heads
    head_dim_pad = max(MIN_TILE, triton.next_power_of_2(head_dim))
    if tile_n is None:
        tile_n = 64 if head_dim_pad <= 128 else 32
    dot_fp32 = INTERPRETED and query.dtype == torch.bfloat16
    # fp32 models asked for fp32: TF32 would cost them ~3 decimal digits in QK^T.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * LOG2E
    block_size = k_cache.shape[1]
    common = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, TILE_N=tile_n,
                  DOT_FP32=dot_fp32, DOT_PRECISION=precision)
    cache_strides = (*k_cache.stride(), *v_cache.stride())
    # Full attention is a window longer than any context: one kernel, no branch.
    window_arg = window if window > 0 else NO_WINDOW

    if meta.is_decode_only:
        span = min(meta.max_seq_len, window) if window > 0 else meta.max_seq_len  # keys a query sees, at most
        if num_splits is None:
            num_splits = _auto_splits(num_seqs, num_kv_heads, span, query.device)
        if num_splits > 1:
            split_len = triton.cdiv(triton.cdiv(span, num_splits), tile_n) * tile_n
            num_splits = triton.cdiv(span, split_len)  # drop splits that would be empty for all
        if num_splits > 1:
            bm = max(MIN_TILE, triton.next_power_of_2(group))
            o_part = torch.empty((num_seqs, num_q_heads, num_splits, head_dim_pad), dtype=torch.float32,
                                 device=query.device)
            lse_part = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=query.device)
            _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
                o_part, lse_part, query, k_cache, v_cache,
                meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                *lse_part.stride(), *query.stride(), *cache_strides, meta.block_tables.stride(0),
                qk_scale, block_size, split_len, window_arg, BLOCK_M=bm, **common)
            _split_reduce_kernel[(num_seqs, num_q_heads)](
                out, o_part, lse_part, meta.cu_seqlens_q, *out.stride(), *lse_part.stride(), num_splits,
                HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits))
            return out

    if block_m is None:
        # Decodes fill rows with query heads only; prefill chunks get taller tiles.
        block_m = 64 if meta.max_query_len * group > MIN_TILE else MIN_TILE
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
        *out.stride(), *query.stride(), *cache_strides, meta.block_tables.stride(0),
        qk_scale, block_size, window_arg, BLOCK_M=block_m, BLOCK_Q=block_q, **common)
    return out


__all__ = ["INTERPRETED", "triton_paged_attention", "triton_store_kv"]
