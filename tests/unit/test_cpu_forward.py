"""The compiled CPU forward (model/cpu_forward.py) and its attention op (attention/cpu.py) against the eager
reference: same logits within float32 rounding on mixed prefill + decode batches, padding that holds NaN never
leaks, and a clean fallback when compiling is switched off or no C++ compiler exists."""
import shutil

import pytest
import torch

from engine_helpers import TINY
from inflight import LLM, SamplingParams
from inflight.attention import AttentionMetadata
from inflight.attention import cpu as cpu_attention
from inflight.attention import reference
from inflight.config import EngineConfig
from inflight.cpu_defaults import resolve_cpu_defaults
from inflight.model import cpu_forward


def _decode_meta(lens, block_size, blocks_per_seq):
    tables = torch.tensor([[i * blocks_per_seq + b for b in range(blocks_per_seq)] for i in range(len(lens))],
                          dtype=torch.int32)
    n = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor([int(tables[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size
                                   for i, L in enumerate(lens)]),
        block_tables=tables, seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), query_lens=[1] * n, seq_lens_host=list(lens),
        max_query_len=1, max_seq_len=max(lens))


def test_decode_attention_equals_reference_and_ignores_nan_padding():
    torch.manual_seed(0)
    block_size, blocks_per_seq, heads, kv_heads, d = 4, 3, 6, 2, 8
    lens = [1, 5, 12, 7]
    meta = _decode_meta(lens, block_size, blocks_per_seq)
    num_blocks = len(lens) * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, d)
    pads = [slice(i * blocks_per_seq * block_size + L, (i + 1) * blocks_per_seq * block_size)
            for i, L in enumerate(lens)]
    for pad in pads:  # past each length the cache may hold anything, NaN in a never-written block
        v_cache.view(-1, kv_heads, d)[pad] = float("nan")
    q = torch.randn(len(lens), heads, d)
    want = reference.paged_attention(q, k_cache, v_cache, meta, 0.3)
    for pad in pads:
        k_cache.view(-1, kv_heads, d)[pad] = float("nan")
    tables = meta.block_tables.long()
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(len(lens), -1)
    got = cpu_attention.decode_attention(q, k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d), slots,
                                         torch.tensor(lens), 0.3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_op_needs_a_step_context():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="step_context"):
        torch.ops.inflight.cpu_attention(q, q[:, :1], q[:, :1], 1.0)
    meta = _decode_meta([1], 4, 1)
    with cpu_attention.step_context(meta, []):
        with pytest.raises(RuntimeError, match="already running"):
            with cpu_attention.step_context(meta, []):
                pass


def _logits(llm, prompts, steps):
    """Logits of every sampled row over a few steps: a mixed first step (prefill chunks beside a one-token
    prompt, which is a decode row), then decode-only steps."""
    engine = llm.engine
    captured = []
    execute = engine.runner.execute

    def recording(*args, **kwargs):
        logits, seqs = execute(*args, **kwargs)
        captured.append(logits.clone())
        return logits, seqs

    engine.runner.execute = recording
    llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return captured


def test_compiled_forward_matches_eager_on_mixed_batches(monkeypatch):
    ids = list(range(100, 160))
    prompts = [ids[:1], ids[:7], ids[:40]]
    # cpu_native_decode=False: llama.py's forward for every step (test_native_decode.py)
    # 32 tokens a step: the 40-token prompt is chunked
    eager = LLM(TINY, num_kv_blocks=64, max_num_batched_tokens=32, cpu_compile=False, cpu_native_decode=False)
    assert eager.engine.runner.forward is eager.engine.runner.model
    want = _logits(eager, prompts, 6)
    compiled = LLM(TINY, num_kv_blocks=64, max_num_batched_tokens=32, cpu_compile=True)
    assert isinstance(compiled.engine.runner.forward, cpu_forward.CompiledCPUForward)
    got = _logits(compiled, prompts, 6)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


def test_compile_switch_and_missing_compiler(monkeypatch):
    monkeypatch.setenv("INFLIGHT_CPU_COMPILE", "maybe")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_COMPILE='maybe' is out of range: allowed true or false"):
        EngineConfig.from_options()
    monkeypatch.setenv("INFLIGHT_CPU_COMPILE", "1")
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert resolve_cpu_defaults(EngineConfig.from_options()).cpu_compile is False
    monkeypatch.delenv("CXX")
    assert resolve_cpu_defaults(EngineConfig.from_options()).cpu_compile is (shutil.which("g++") is not None)
    monkeypatch.delenv("INFLIGHT_CPU_COMPILE")
    # opt-in until measured faster on a quiet machine
    assert resolve_cpu_defaults(EngineConfig.from_options()).cpu_compile is False


def test_a_failed_compile_reruns_the_step_eagerly_and_stays_eager(monkeypatch):
    llm = LLM(TINY, num_kv_blocks=32, cpu_compile=True)
    forward = llm.engine.runner.forward
    assert isinstance(forward, cpu_forward.CompiledCPUForward)

    def broken(*args):
        raise torch._dynamo.exc.BackendCompilerFailed(broken, RuntimeError("no toolchain"), None)

    monkeypatch.setattr(forward, "_compiled", broken)
    prompt = list(range(100, 110))
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert forward.is_eager
    eager = LLM(TINY, num_kv_blocks=32, cpu_compile=False)
    want = eager.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].token_ids == want[0].token_ids
