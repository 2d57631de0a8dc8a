"""Speculative verification through the Triton kernels (interpreter on CPU hosts, compiled on GPU ones): a sequence's
newest token and its drafts run as decode rows sharing one block table (model_runner._verification_rows), which must
attend exactly as the causal chunk of the same tokens would, across a block boundary and beside other rows; and the
engine's greedy outputs with drafts equal those without, with CUDA graphs replaying the plain decode steps and the
verification steps falling back to eager ones."""
from __future__ import annotations

import os

import pytest
import torch

from inflight import LLM, SamplingParams
from inflight.attention import AttentionMetadata
from inflight.attention import reference as ref

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tiny-llama")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _meta(rows: list[tuple[int, int, int]], tables: list[list[int]], bs: int, device) -> AttentionMetadata:
    """rows: (table index, query_len, seq_len) per row of the batch, its tokens at the end of its context."""
    slots, q_lens, s_lens, row_tables = [], [], [], []
    width = max(len(t) for t in tables)
    for table_index, q_len, s_len in rows:
        table = tables[table_index]
        slots += [table[p // bs] * bs + p % bs for p in range(s_len - q_len, s_len)]
        q_lens.append(q_len)
        s_lens.append(s_len)
        row_tables.append(table + [0] * (width - len(table)))
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), block_tables=torch.tensor(row_tables, dtype=torch.int32,
                                                                                    device=device),
        seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device), query_lens=q_lens, seq_lens_host=s_lens,
        max_query_len=max(q_lens), max_seq_len=max(s_lens))


def test_verification_rows_attend_as_the_causal_chunk(tk, device):
    """Sequence 0 verifies 4 drafts: positions 13-17 of blocks of 8 (a boundary at 16), as 5 decode rows; beside
    it a plain decode (sequence 1) and a prefill chunk (sequence 2). The kernels' output for the 5 rows equals the
    reference attention of the same 5 tokens as one causal chunk."""
    gen = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, d = 8, 4, 2, 16
    tables = [[3, 7, 1], [5, 2], [4, 6, 8]]
    num_blocks = 10
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    k_cache[0] = v_cache[0] = float("nan")  # table padding points here: never read
    rows_as_chunk = [(0, 5, 18), (1, 1, 11), (2, 6, 20)]
    rows_expanded = [(0, 1, 14), (0, 1, 15), (0, 1, 16), (0, 1, 17), (0, 1, 18), (1, 1, 11), (2, 6, 20)]
    tokens = 5 + 1 + 6
    q = torch.randn(tokens, heads, d, generator=gen)
    k = torch.randn(tokens, kv_heads, d, generator=gen)
    v = torch.randn(tokens, kv_heads, d, generator=gen)
    scale = d ** -0.5

    chunk = _meta(rows_as_chunk, tables, bs, "cpu")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, want_k, want_v, chunk.slot_mapping)
    want = ref.paged_attention(q, want_k.nan_to_num(), want_v.nan_to_num(), chunk, scale)

    rows = _meta(rows_expanded, tables, bs, device)
    got_k, got_v = k_cache.clone().to(device), v_cache.clone().to(device)
    tk.triton_store_kv(k.to(device), v.to(device), got_k, got_v, rows.slot_mapping)
    got = tk.triton_paged_attention(q.to(device), got_k, got_v, rows, scale)
    torch.testing.assert_close(got_k.cpu().nan_to_num(), want_k.nan_to_num())
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    # The torch reference takes the same rows the same way (the CPU path without the native step).
    ref_rows = _meta(rows_expanded, tables, bs, "cpu")
    torch.testing.assert_close(ref.paged_attention(q, want_k.nan_to_num(), want_v.nan_to_num(), ref_rows, scale),
                               want, atol=1e-5, rtol=1e-5)


def test_engine_outputs_with_drafts_through_the_kernels_equal_without(tk, device, monkeypatch):
    """tiny-llama with attention_backend=triton: on a CPU host the model's torch forward calls the kernels in the
    interpreter (the native step, which has its own attention, is off); on a GPU host the CUDA runner, where plain
    decode steps replay CUDA graphs and steps with drafts run eagerly."""
    options = dict(device=device.type, dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=4,
                   max_model_len=256, attention_backend="triton", cpu_native_decode=False)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 4, 9, 4, 9, 4, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate(**spec):
        llm = LLM(TINY, **options, **spec)
        eager, replayed = [], []
        static = llm.engine.runner.static_decode
        if static is not None:
            forward = static.forward

            def counting(ids, *args):
                replayed.append(ids.shape[0] in static.graphs)
                return forward(ids, *args)
            static.forward = counting
            prepare = llm.engine.runner.prepare
            llm.engine.runner.prepare = lambda scheduled: eager.append(
                any(seq.spec_token_ids for seq, _ in scheduled)) or prepare(scheduled)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [o.token_ids for o in outs], eager, replayed

    calls = []
    kernel = tk.triton_paged_attention
    monkeypatch.setattr(tk, "triton_paged_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    _, want, _, _ = generate(speculative_method="off")
    llm, got, eager, replayed = generate(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                             speculative_draft_policy="always")
    assert got == want
    c = llm.engine.metrics.snapshot()["counters"]
    assert c["spec_decode_num_accepted_tokens"] > 0 and calls
    if device.type == "cuda":
        assert any(replayed) and any(eager), "expected graph replays for plain decodes, eager verification steps"
