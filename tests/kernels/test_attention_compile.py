"""The paged-attention kernels compile to sm_90 machine code without a GPU (see hopper_compile.py).

The Python wrappers in triton_kernels.py are called with CPU tensors of real model shapes and their launches
recorded, so every variant compiled has the constexprs and argument specialisation the wrappers pass now.
"""
from __future__ import annotations

from hopper_compile import run_compile_script

_COMPILE_SM90 = """
import torch
from hopper_compile import capture_launches, compile_for_sm90
from gpu_variants import step  # the wrappers called as llama.py calls them
from inflight.attention import triton_kernels as tk

KERNELS = ("_store_kv_kernel", "_paged_attention_kernel", "_split_decode_kernel", "_split_reduce_kernel")
MODELS = {"Qwen2-0.5B": (14, 2), "SmolLM2-135M": (9, 3)}  # query heads, KV heads; head_dim 64 for both
HEAD_DIM, MAX_MODEL_LEN = 64, 4096  # block_size 16 (step's default)


# The kernels only run on CUDA tensors; here nothing runs, and only dtypes, strides and alignment matter.
tk._check_device = lambda *tensors: None
with capture_launches(tk, KERNELS) as launches:
    for q_heads, kv_heads in MODELS.values():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            case = lambda *a, **kw: step(q_heads, kv_heads, HEAD_DIM, dtype, *a, **kw)  # noqa: E731
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
