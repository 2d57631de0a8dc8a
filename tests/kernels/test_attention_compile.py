"""The paged-attention kernels compile to sm_90 machine code without a GPU (see hopper_compile.py).

The Python wrappers in triton_kernels.py are called with CPU tensors of real model shapes and their launches
recorded, so every variant compiled has the constexprs and argument specialisation the wrappers pass now.
"""
from __future__ import annotations

from hopper_compile import run_compile_script

_COMPILE_SM90 = """
import torch
from hopper_compile import capture_launches, compile_for_sm90
from inflight.attention import AttentionMetadata
from inflight.attention import triton_kernels as tk

KERNELS = ("_store_kv_kernel", "_paged_attention_kernel", "_split_decode_kernel", "_split_reduce_kernel")
MODELS = {"Qwen2-0.5B": (14, 2), "SmolLM2-135M": (9, 3)}  # query heads, KV heads; head_dim 64 for both
HEAD_DIM, BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS = 64, 16, 4096, 512


def step(q_heads, kv_heads, dtype, query_lens, seq_lens, max_seq_len=None, num_splits=None):
    # Shaped as llama.py passes them: q and k are RoPE outputs, v a view into the fused QKV projection;
    # a cache is one layer of [layers, blocks, block_size, kv_heads, head_dim].
    tokens = sum(query_lens)
    qkv = torch.empty(tokens, (q_heads + 2 * kv_heads) * HEAD_DIM, dtype=dtype)
    q = torch.empty(tokens, q_heads, HEAD_DIM, dtype=dtype)
    k = torch.empty(tokens, kv_heads, HEAD_DIM, dtype=dtype)
    v = qkv[:, (q_heads + kv_heads) * HEAD_DIM:].view(tokens, kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.empty(2, 2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, HEAD_DIM, dtype=dtype)[:, 1]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(torch.arange(tokens), torch.zeros(len(query_lens), MAX_MODEL_LEN // BLOCK_SIZE,
                             dtype=torch.int32), i32(seq_lens), i32(cu), list(query_lens), list(seq_lens),
                             max(query_lens), max_seq_len or max(seq_lens))
    tk.triton_store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    tk.triton_paged_attention(q, k_cache, v_cache, meta, HEAD_DIM ** -0.5, num_splits=num_splits)


# The kernels only run on CUDA tensors; here nothing runs, and only dtypes, strides and alignment matter.
tk._check_device = lambda *tensors: None
with capture_launches(tk, KERNELS) as launches:
    for q_heads, kv_heads in MODELS.values():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            case = lambda *a, **kw: step(q_heads, kv_heads, dtype, *a, **kw)  # noqa: E731
            case([37, 5, 1, 1], [37, 100, 50, 300])  # mixed batch: prefill chunks and decodes, tall tiles
            case([1] * 8, [300] * 8, MAX_MODEL_LEN, num_splits=1)  # decode batch too big to split
            case([1], [300], MAX_MODEL_LEN)  # lone decode: split-KV, as many splits as the wrapper picks
            case([1], [300], MAX_MODEL_LEN, num_splits=tk.MAX_SPLITS)  # widest reduce
for line in compile_for_sm90(launches):
    print(line)
print("compiled")
"""


def test_attention_kernels_compile_for_hopper_without_a_gpu(device):
    """Store, unified paged attention, split-KV decode and its reduce: bf16, fp16 and fp32, for the head
    layouts of Qwen2-0.5B (14 query / 2 KV heads) and SmolLM2-135M (9 / 3), head_dim 64, block_size 16."""
    out = run_compile_script(_COMPILE_SM90, device)
    for kernel in ("_store_kv_kernel", "_paged_attention_kernel", "_split_decode_kernel", "_split_reduce_kernel"):
        assert kernel in out, out
