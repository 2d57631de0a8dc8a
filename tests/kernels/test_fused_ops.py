"""Triton RMSNorm (+ residual add) and SiLU-and-mul against llama.py's torch ops, and the fused forward
against LlamaForCausalLM.forward on the tiny test model."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hopper_compile import run_compile_script
from inflight.attention import AttentionMetadata
from inflight.model import llama

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tiny-llama")
# Same rounding points as torch: what is left is the order of the sum of squares and exp's last bit.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOL)


@pytest.fixture(scope="module")
def ops(device):
    from inflight.model import triton_ops
    assert triton_ops.INTERPRETED == (device.type == "cpu")
    return triton_ops


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: the block is padded past the row
def test_rms_norm_matches_torch(ops, device, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = llama.RMSNorm(hidden, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen))
    norm = norm.to(device=device, dtype=dtype)
    x = torch.randn(5, hidden, generator=gen).to(device=device, dtype=dtype)
    out, res = ops.rms_norm(x, norm.weight, norm.eps)
    assert res is None
    _close(out, norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_torch(ops, device, dtype):
    gen = torch.Generator().manual_seed(1)
    hidden = 96
    norm = llama.RMSNorm(hidden, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, generator=gen))
    norm = norm.to(device=device, dtype=dtype)
    x = torch.randn(7, hidden, generator=gen).to(device=device, dtype=dtype)
    residual = torch.randn(7, hidden, generator=gen).to(device=device, dtype=dtype)
    out, res = ops.rms_norm(x, norm.weight, norm.eps, residual)
    want_res = residual + x
    if ops.INTERPRETED and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 instead of rounding
        _close(res, want_res, dtype)
    else:
        assert torch.equal(res, want_res), "the residual sum must round exactly as torch's add"
    _close(out, norm(want_res), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [80, 1100])  # 1100: more than one column block per row
def test_silu_and_mul_matches_torch(ops, device, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (3 * torch.randn(3, 2 * inter, generator=gen)).to(device=device, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    _close(ops.silu_and_mul(x), F.silu(gate) * up, dtype)


def test_empty_batch(ops, device):
    w = torch.ones(8, device=device)
    assert ops.rms_norm(torch.empty(0, 8, device=device), w, 1e-6)[0].shape == (0, 8)
    assert ops.silu_and_mul(torch.empty(0, 16, device=device)).shape == (0, 8)


@pytest.mark.skipif(not os.path.exists(os.path.join(TINY, "config.json")), reason="models/tiny-llama missing")
def test_fused_forward_matches_model_forward(ops, device):
    """Two prompts in one flat batch, then one decode each, through the fused and the plain forward."""
    from inflight.model import load_model
    from inflight.model.fused_forward import fused_forward

    model = load_model(TINY, torch.float32, device)
    cfg = model.cfg
    bs, num_blocks = 8, 8

    def caches():
        shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        return [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
                for _ in range(cfg.num_layers)]

    def meta(q_lens, seq_lens, tables):
        slots = []
        for q, s, t in zip(q_lens, seq_lens, tables):
            slots += [t[p // bs] * bs + p % bs for p in range(s - q, s)]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
        return AttentionMetadata(t(slots, torch.int64), t(tables, torch.int32), t(seq_lens, torch.int32),
                                 t(cu, torch.int32), q_lens, seq_lens, max(q_lens), max(seq_lens))

    tables = [[3, 1], [2, 5]]
    prefill = meta([11, 6], [11, 6], tables)
    decode = meta([1, 1], [12, 7], tables)
    ids = torch.tensor(list(range(100, 111)) + list(range(300, 306)), device=device)
    pos = torch.tensor(list(range(11)) + list(range(6)), device=device)
    ids2, pos2 = torch.tensor([7, 9], device=device), torch.tensor([11, 6], device=device)
    results = []
    with torch.inference_mode():
        for fwd in (model.forward, lambda *a: fused_forward(model, *a)):
            kv = caches()
            results.append((fwd(ids, pos, prefill, kv), fwd(ids2, pos2, decode, kv)))
    (want_p, want_d), (got_p, got_d) = results
    torch.testing.assert_close(got_p, want_p, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_d, want_d, rtol=1e-4, atol=1e-4)


_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from inflight.model import triton_ops as ops
target = GPUTarget("cuda", 90, 32)
for dt in ("bf16", "fp32"):
    for has_res in (True, False):
        sig = {n: f"*{dt}" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
        sig.update(dict.fromkeys(("stride_x", "stride_r", "stride_o", "stride_ro", "n_cols"), "i32"))
        sig.update(eps="fp32", HAS_RESIDUAL="constexpr", BLOCK="constexpr")
        triton.compile(ASTSource(ops._rms_norm_kernel, sig, constexprs={"HAS_RESIDUAL": has_res, "BLOCK": 1024}),
                       target=target)
    sig = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "stride_x": "i32", "stride_o": "i32", "n_cols": "i32",
           "BLOCK": "constexpr"}
    triton.compile(ASTSource(ops._silu_and_mul_kernel, sig, constexprs={"BLOCK": 1024}), target=target)
print("compiled")
"""


def test_kernels_compile_for_hopper_without_a_gpu(device):
    """The interpreter accepts code the compiler rejects: build both kernels to sm_90 machine code (triton's
    bundled ptxas) in a process without the interpreter, so a CPU-only CI catches that too."""
    run_compile_script(_COMPILE_SM90, device)
