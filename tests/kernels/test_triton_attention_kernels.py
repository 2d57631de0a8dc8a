"""Triton store / paged-attention kernels against the torch reference on mixed, decode and prefill batches."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from inflight import attention
from inflight.attention import AttentionMetadata
from inflight.attention import reference as ref
from inflight.config import EngineConfig

RATIOS = [(4, 4), (8, 2), (5, 1)]  # q_heads:kv_heads; 5:1 is a non-power-of-two group
# The interpreter turns loop bounds loaded from memory into ints via a 1-element array (numpy 1.25+ warns).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Shape:
    head_dim: int
    block_size: int
    mixed: list[tuple[int, int]]  # (query_len, seq_len): seq_len counts cached + new tokens
    decode: list[tuple[int, int]]


# The interpreter runs programs one by one in numpy: the production batch [(1, 1328), (5, 18), (129, 463)]
# is scaled down, keeping what matters: lengths that are not multiples of the block size, a chunk with
# cached context, a query tile boundary inside a chunk.
CPU = Shape(head_dim=16, block_size=8, mixed=[(1, 83), (5, 18), (9, 29)],
            decode=[(1, 83), (1, 18), (1, 29), (1, 1)])
GPU = Shape(head_dim=128, block_size=16, mixed=[(1, 1328), (5, 18), (129, 463)],
            decode=[(1, 1328), (1, 18), (1, 463), (1, 1), (1, 4099)])


@pytest.fixture(scope="module")
def shape(device: torch.device) -> Shape:
    return GPU if device.type == "cuda" else CPU


@dataclass
class Batch:
    query: torch.Tensor
    key: torch.Tensor  # the new tokens' K/V, stored by the code under test
    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(specs: list[tuple[int, int]], q_heads: int, kv_heads: int, shape: Shape, dtype: torch.dtype,
               device: torch.device, seed: int = 0) -> Batch:
    """Caches full of NaN except each sequence's cached prefix, shuffled block tables, packed-QKV views."""
    gen = torch.Generator().manual_seed(seed)
    d, bs = shape.head_dim, shape.block_size
    blocks_per_seq = [(s + bs - 1) // bs for _, s in specs]
    num_blocks = sum(blocks_per_seq) + 4
    # Block 0 is never handed out: it is what table padding points at, and it stays all NaN.
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(specs), max(blocks_per_seq), dtype=torch.int32)
    for row, n in enumerate(blocks_per_seq):
        tables[row, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]

    k_cache = torch.full((num_blocks, bs, kv_heads, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    cached_slots, new_slots = [], []
    for row, (q_len, s_len) in enumerate(specs):
        pos = torch.arange(s_len)
        slots = tables[row, pos // bs].long() * bs + pos % bs
        cached_slots.append(slots[: s_len - q_len])
        new_slots.append(slots[s_len - q_len:])
    cached = torch.cat(cached_slots)
    ref.store_kv(torch.randn(len(cached), kv_heads, d, generator=gen).to(dtype),
                 torch.randn(len(cached), kv_heads, d, generator=gen).to(dtype), k_cache, v_cache, cached)

    q_lens = [q for q, _ in specs]
    s_lens = [s for _, s in specs]
    tokens = sum(q_lens)
    # One packed projection output, as the model produces it: Q, K, V are strided views, not copies.
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    query = qkv[:, : q_heads * d].view(tokens, q_heads, d)
    key = qkv[:, q_heads * d: (q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    value = qkv[:, (q_heads + kv_heads) * d:].view(tokens, kv_heads, d)
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots).to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu.to(device),
        query_lens=q_lens, seq_lens_host=s_lens, max_query_len=max(q_lens), max_seq_len=max(s_lens))
    return Batch(query.to(device), key.to(device), value.to(device), k_cache.to(device), v_cache.to(device),
                 meta)


def expected(batch: Batch, scale: float, window: int = 0) -> torch.Tensor:
    """The reference in fp32 on the same cache with NaN garbage zeroed.

    Zeroing is needed because the reference's decode path attends over whole padded blocks and relies on
    the mask: softmax weight 0 times a NaN value is NaN. The kernels must cope with the NaN themselves.
    """
    k = batch.k_cache.float().nan_to_num()
    v = batch.v_cache.float().nan_to_num()
    return ref.paged_attention(batch.query.float(), k, v, batch.meta, scale, window=window)


def check_attention(out: torch.Tensor, batch: Batch, scale: float, window: int = 0) -> None:
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert not out.isnan().any(), "NaN from unwritten cache slots reached the output"
    tol = TOL[batch.query.dtype]
    torch.testing.assert_close(out.float(), expected(batch, scale, window), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference_and_skips_minus_one(tk, shape, device, dtype):
    batch = make_batch(shape.mixed, 8, 2, shape, dtype, device)
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1  # e.g. tokens whose KV is already cached
    want_k, want_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref.store_kv(batch.key, batch.value, want_k, want_v, slots)

    tk.triton_store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, slots)

    # Bit-exact, NaN where nothing was written (so skipped tokens landed nowhere).
    torch.testing.assert_close(batch.k_cache, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, want_v, atol=0, rtol=0, equal_nan=True)


def test_store_kv_skipped_slot_stays_untouched(tk, shape, device):
    batch = make_batch([(4, 4)], 4, 4, shape, torch.float32, device)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    tk.triton_store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, slots)
    flat_k = batch.k_cache.flatten(0, 1)
    flat_v = batch.v_cache.flatten(0, 1)
    skipped = batch.meta.slot_mapping[1]
    assert flat_k[skipped].isnan().all() and flat_v[skipped].isnan().all()
    written = slots[slots >= 0]
    torch.testing.assert_close(flat_k[written], batch.key[[0, 2, 3]], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[written], batch.value[[0, 2, 3]], atol=0, rtol=0)


def test_store_kv_empty_batch_is_a_no_op(tk, device):
    cache = torch.zeros(2, 4, 1, 16, device=device)
    empty = torch.empty(0, 1, 16, device=device)
    tk.triton_store_kv(empty, empty, cache, cache.clone(), torch.empty(0, dtype=torch.int64, device=device))
    assert not cache.any()


# ---------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_heads,kv_heads", RATIOS)
def test_mixed_batch_store_then_attend(tk, shape, device, q_heads, kv_heads, dtype):
    batch = make_batch(shape.mixed, q_heads, kv_heads, shape, dtype, device, seed=q_heads)
    scale = shape.head_dim ** -0.5
    tk.triton_store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    check_attention(out, batch, scale)


@pytest.mark.parametrize("q_heads,kv_heads", RATIOS)
def test_mixed_batch_small_tiles(tk, shape, device, q_heads, kv_heads):
    """16-row / 16-key tiles: several query tiles per chunk and many KV tiles per sequence."""
    batch = make_batch(shape.mixed, q_heads, kv_heads, shape, torch.float32, device, seed=10 + q_heads)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.3,
                                    block_m=16, tile_n=16)
    check_attention(out, batch, 0.3)


def test_mixed_batch_bfloat16(tk, shape, device):
    batch = make_batch(shape.mixed, 8, 2, shape, torch.bfloat16, device, seed=3)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25)
    check_attention(out, batch, 0.25)


def test_prefill_without_and_with_cached_context(tk, shape, device):
    """Fresh prompts (seq_len == query_len) next to a chunk starting mid-block after cached tokens."""
    specs = [(13, 13), (7, 7), (6, 19), (2, 2 * shape.block_size)]
    batch = make_batch(specs, 5, 1, shape, torch.float32, device, seed=5)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.2, block_m=16)
    check_attention(out, batch, 0.2)


@pytest.mark.parametrize("q_heads,kv_heads", RATIOS)
@pytest.mark.parametrize("num_splits", [1, 4], ids=["unified", "split_kv"])
def test_decode_only(tk, shape, device, q_heads, kv_heads, num_splits):
    """Decodes through the unified kernel and through split-KV + reduce (some splits empty)."""
    batch = make_batch(shape.decode, q_heads, kv_heads, shape, torch.float16, device, seed=20 + q_heads)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25,
                                    tile_n=16, num_splits=num_splits)
    check_attention(out, batch, 0.25)


def poison_blocks_before_window(batch: Batch, window: int, align: int) -> None:
    """NaN into every block that lies wholly before each sequence's first query's window start, rounded down to
    `align` positions: blocks the kernel claims never to read (a read would put NaN in the output)."""
    bs = batch.k_cache.shape[1]
    for row, (q_len, s_len) in enumerate(zip(batch.meta.query_lens, batch.meta.seq_lens_host)):
        lo = max(0, s_len - q_len - window + 1) // align * align
        for j in range(lo // bs):
            block = int(batch.meta.block_tables[row, j])
            batch.k_cache[block] = float("nan")
            batch.v_cache[block] = float("nan")


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["unified", "split_kv"])
def test_sliding_window_matches_reference_and_reads_no_block_before_it(tk, shape, device, kind, num_splits):
    """A window of a few blocks (not a multiple of the block size) over contexts far longer: the kernels mask
    as the reference does (key > query - window) and skip the blocks before the window."""
    window = 3 * shape.block_size - 5
    specs = shape.mixed if kind == "mixed" else shape.decode
    batch = make_batch(specs, 8, 2, shape, torch.float32, device, seed=31)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    want = expected(batch, 0.25, window)
    tile_n = 16
    poison_blocks_before_window(batch, window, max(tile_n, shape.block_size))
    out = tk.triton_paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25,
                                    tile_n=tile_n, num_splits=num_splits, window=window)
    assert not out.isnan().any(), "a block before the window was read"
    torch.testing.assert_close(out.float(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    full = expected(batch, 0.25)
    assert not torch.allclose(full, want), "the window changed nothing: the test would not see it ignored"


def test_reference_window_reads_no_block_before_it(shape):
    """The torch reference (CPU path) gathers from the first block of each window only."""
    window = 2 * shape.block_size + 3
    batch = make_batch(shape.mixed + [(1, 5 * shape.block_size + 2)], 8, 2, shape, torch.float32,
                       torch.device("cpu"), seed=32)
    ref.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    batch.k_cache.nan_to_num_(), batch.v_cache.nan_to_num_()  # the reference relies on its mask for padding
    want = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window=window)
    poison_blocks_before_window(batch, window, 1)
    out = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, window=window)
    assert not out.isnan().any(), "a block before the window was read"
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_auto_splits_only_when_the_gpu_would_idle(tk):
    cpu = torch.device("cpu")  # counts as 4 SMs: a target of 8 programs
    assert tk._auto_splits(num_seqs=64, num_kv_heads=8, max_seq_len=4096, device=cpu) == 1
    assert tk._auto_splits(num_seqs=1, num_kv_heads=1, max_seq_len=100, device=cpu) == 1
    assert tk._auto_splits(num_seqs=1, num_kv_heads=1, max_seq_len=100_000, device=cpu) == 8
    assert tk._auto_splits(num_seqs=1, num_kv_heads=2, max_seq_len=600, device=cpu) == 2


# ---------------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------------
def test_dispatch_follows_device_and_env(tk, shape, device, monkeypatch):
    batch = make_batch(shape.mixed, 4, 4, shape, torch.float32, device)
    calls = []
    real_attn, real_store = tk.triton_paged_attention, tk.triton_store_kv
    monkeypatch.setattr(tk, "triton_paged_attention", lambda *a, **k: calls.append("attn") or real_attn(*a, **k))
    monkeypatch.setattr(tk, "triton_store_kv", lambda *a: calls.append("store") or real_store(*a))

    attention.store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping,
                       backend="triton")
    out = attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.25, backend="triton")
    assert calls == ["store", "attn"]
    check_attention(out, batch, 0.25)

    calls.clear()
    attention.paged_attention(batch.query, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(), batch.meta, 1.0,
                              backend="torch")
    attention.paged_attention(batch.query, batch.k_cache.nan_to_num(), batch.v_cache.nan_to_num(), batch.meta, 1.0)
    assert calls == ([] if device.type == "cpu" else ["attn"])  # auto: the kernels for CUDA tensors only

    with pytest.raises(ValueError, match="attention_backend='cuda' is out of range: allowed auto, triton, torch"):
        attention.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 1.0, backend="cuda")
    # The operator's override reaches the model's layers through the engine config.
    monkeypatch.setenv("INFLIGHT_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="INFLIGHT_ATTENTION='cuda' is out of range: allowed auto, triton, torch"):
        EngineConfig.from_options()
    monkeypatch.setenv("INFLIGHT_ATTENTION", "torch")
    assert EngineConfig.from_options(attention_backend="triton").attention_backend == "torch"


def test_importing_attention_does_not_import_triton():
    code = ("import sys; import inflight.attention; "
            "assert 'triton' not in sys.modules, 'inflight.attention imported triton eagerly'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
