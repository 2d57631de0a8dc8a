"""The Triton kernel variants a first GPU session compiles cold, built here for sm_90 without a GPU.

Settles two risks before device minutes are spent: how long compiling them takes (perf/gpu/check.sh gives
the kernel tests a fixed timeout, and a cold Triton cache compiles every variant) and whether any variant
needs more shared memory than an H100/H200 block may have (it would fail only at launch, on the GPU).

The launches are those of the GPU runs: tests/kernels/test_triton_attention_kernels.py at its GPU shape
(head_dim 128, block 16), the fused-op tests, tests/kernels/test_cuda_runner.py (tiny-llama, fp32 and bf16,
decode buckets 1-8) and perf/gpu/bench.py (Qwen2-0.5B shape, bf16, decode buckets 1-256 at max_model_len
4096, 132 SMs for the split-KV choice). Each wrapper is called with CPU tensors of those shapes while its
kernels only record what they are launched with; every distinct variant is then compiled as JITFunction.run
would on an sm_90 device.

    TRITON_INTERPRET=0 PYTHONPATH=backend_src:tests/kernels .venv/bin/python tests/kernels/gpu_variants.py --json F

perf/gpu/check.sh also runs it on the GPU host before the kernel tests, with a process per core: the compiled
kernels land in triton's cache under the keys the tests' launches compute, so the tests (with their timeout)
find most of them compiled; any it misses they compile as before.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

import torch

from hopper_compile import SM90_MAX_SHARED, capture_launches, compile_for_sm90
from inflight.attention import AttentionMetadata
from inflight.attention import triton_kernels as tk
from inflight.model import triton_ops as ops

ATTENTION_KERNELS = ("_store_kv_kernel", "_paged_attention_kernel", "_split_decode_kernel", "_split_reduce_kernel")
OP_KERNELS = ("_rms_norm_kernel", "_silu_and_mul_kernel")
H100_SMS = 132  # H100 SXM and H200 both have 132


def _auto_splits_on_hopper(num_seqs, num_kv_heads, max_seq_len, device):
    """The wrapper's split choice as on a 132-SM GPU (on a CPU tensor it would count 4 SMs)."""
    programs = num_seqs * num_kv_heads
    if programs >= 2 * H100_SMS:
        return 1
    return max(1, min(-(-2 * H100_SMS // programs), max_seq_len // tk.MIN_SPLIT_LEN, tk.MAX_SPLITS))


def step(q_heads: int, kv_heads: int, head_dim: int, dtype, query_lens, seq_lens, max_seq_len=None,
         block_size: int = 16, max_model_len: int = 4096, **overrides) -> None:
    """One store and one attention call shaped as llama.py makes them: q and k contiguous (RoPE outputs),
    v a view into the fused QKV projection, a cache one layer of [layers, blocks, block, kv_heads, head_dim]."""
    tokens = sum(query_lens)
    qkv = torch.empty(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = torch.empty(tokens, q_heads, head_dim, dtype=dtype)
    k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
    v = qkv[:, (q_heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    k_cache, v_cache = torch.empty(2, 2, 64, block_size, kv_heads, head_dim, dtype=dtype)[:, 1]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(torch.arange(tokens), torch.zeros(len(query_lens), max_model_len // block_size,
                             dtype=torch.int32), i32(seq_lens), i32(cu), list(query_lens), list(seq_lens),
                             max(query_lens), max_seq_len or max(seq_lens))
    tk.triton_store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    tk.triton_paged_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, **overrides)


def test_suite_attention() -> None:
    """test_triton_attention_kernels.py on a GPU: head_dim 128, block 16 (its tensors are packed views too)."""
    mixed = ([1, 5, 129], [1328, 18, 463])
    decode = ([1] * 5, [1328, 18, 463, 1, 4099])
    for q_heads, kv_heads in ((4, 4), (8, 2), (5, 1)):
        for dtype in (torch.float32, torch.float16):
            step(q_heads, kv_heads, 128, dtype, *mixed)
        step(q_heads, kv_heads, 128, torch.float32, *mixed, block_m=16, tile_n=16)
        for splits in (1, 4):
            step(q_heads, kv_heads, 128, torch.float16, *decode, tile_n=16, num_splits=splits)
    step(8, 2, 128, torch.bfloat16, *mixed)
    step(5, 1, 128, torch.float32, [13, 7, 6, 2], [13, 7, 19, 32], block_m=16)


def engine_attention(q_heads: int, kv_heads: int, head_dim: int, dtype, max_num_seqs: int,
                     max_model_len: int) -> None:
    """An engine's steps: prefill chunks (some with cached context) and padded decode buckets, whose
    max_seq_len is pinned to max_model_len (what a CUDA graph replays)."""
    step(q_heads, kv_heads, head_dim, dtype, [37, 5, 1], [37, 100, 50], max_model_len=max_model_len)
    bucket = 1
    while True:
        step(q_heads, kv_heads, head_dim, dtype, [1] * bucket, [100] * bucket, max_model_len,
             max_model_len=max_model_len)
        if bucket >= max_num_seqs:
            break
        bucket = min(2 * bucket, max_num_seqs)


def fused_ops() -> None:
    """test_fused_ops.py's shapes, tiny-llama's (hidden 64, inter 128) and the Qwen2-0.5B shape's."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hidden in (64, 96, 896):
            x = torch.empty(5, hidden, dtype=dtype)
            w = torch.empty(hidden, dtype=dtype)
            ops.rms_norm(x, w, 1e-6)
            ops.rms_norm(x, w, 1e-6, torch.empty_like(x))
        for inter in (80, 128, 1100, 4864):
            ops.silu_and_mul(torch.empty(3, 2 * inter, dtype=dtype))


LAUNCHES: list = []  # filled before the workers fork, which compile a share each


def _compile_share(share: tuple[int, int]) -> list[dict]:
    index, count = share
    stats: list[dict] = []
    compile_for_sm90(LAUNCHES[index::count], stats)
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the per-variant figures here")
    ap.add_argument("--jobs", type=int, default=1, help="compiling processes")
    args = ap.parse_args(argv)
    tk._check_device = lambda *tensors: None  # nothing runs: only dtypes, strides and alignment matter
    ops._check = lambda *tensors: None
    tk._auto_splits = _auto_splits_on_hopper
    with capture_launches(tk, ATTENTION_KERNELS) as launches, capture_launches(ops, OP_KERNELS) as op_launches:
        test_suite_attention()
        engine_attention(4, 2, 16, torch.float32, 8, 256)  # test_cuda_runner: tiny-llama
        engine_attention(4, 2, 16, torch.bfloat16, 8, 256)
        engine_attention(14, 2, 64, torch.bfloat16, 256, 4096)  # gpu_bench: Qwen2-0.5B shape
        fused_ops()
    LAUNCHES[:] = launches + op_launches
    t0 = time.perf_counter()
    if args.jobs > 1:  # forked: the children inherit the recorded launches (no CUDA is ever initialised here)
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            stats = [s for part in pool.map(_compile_share, [(i, args.jobs) for i in range(args.jobs)]) for s in part]
    else:
        stats = _compile_share((0, 1))
    seconds = time.perf_counter() - t0
    worst = max(stats, key=lambda s: s["shared"])
    over = [s for s in stats if s["shared"] > SM90_MAX_SHARED]
    cpu = sum(s["cpu_seconds"] for s in stats)
    print(f"{len(stats)} variants compiled for sm_90 in {seconds:.1f} s ({cpu:.1f} s of CPU, {args.jobs} processes); "
          f"most shared memory: {worst['shared']} B "
          f"({worst['kernel']} {worst['dtypes']} {worst['constexprs']}); limit {SM90_MAX_SHARED} B; over: {len(over)}")
    for s in sorted(stats, key=lambda s: -s["shared"])[:8]:
        print(f"  {s['shared']:6d} B  {s['cpu_seconds']:5.1f} s CPU  {s['kernel']} {s['dtypes']} {s['constexprs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"compile_seconds": seconds, "compile_cpu_seconds": cpu, "jobs": args.jobs,
                       "limit": SM90_MAX_SHARED, "variants": stats}, f, indent=2)
    print("compiled")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
