"""The CPU forward: llama.py's decoder compiled by torch's inductor into one graph for all layers.

Why: on a small model the eager forward spends much of a step in per-op overhead (about 1,000 torch calls
for 30 layers, each with Python and dispatch costs and, at 2 threads, an OpenMP fork-join). Inductor's C++
codegen fuses each RMSNorm, RoPE, SiLU-and-mul and residual add into one loop and calls the linears and the
attention op (attention/cpu.py) from one generated wrapper. Same modules, same weights, same math as
LlamaForCausalLM.forward; only the summation order inside fused loops can differ (within float32 rounding).

Needs a C++ compiler (inductor builds its kernels with the system's g++); without one, or with
INFLIGHT_CPU_COMPILE=0, the runner keeps the eager forward.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil

import torch

from ..attention import AttentionMetadata
from ..attention import cpu as cpu_attention
from .llama import LlamaForCausalLM

log = logging.getLogger(__name__)

COMPILE_ENV = "INFLIGHT_CPU_COMPILE"


def compile_choice() -> bool:
    """INFLIGHT_CPU_COMPILE: 1 (default) compiles where a C++ compiler exists, 0 keeps the eager forward."""
    choice = os.environ.get(COMPILE_ENV, "1").strip().lower() or "1"
    if choice not in ("0", "1"):
        raise ValueError(f"{COMPILE_ENV}={choice!r} is not one of 0, 1")
    if choice == "0":
        return False
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        log.warning("no C++ compiler (%s) on PATH: the CPU forward stays eager (slower)", compiler)
        return False
    return True


def _body(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = model.embed_tokens(input_ids)
    cos, sin = model.rope_cos_sin(positions)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(x), cos, sin)
        o = torch.ops.inflight.cpu_attention(q, k, v, i, attn.scale)
        x = x + attn.o_proj(o.reshape(-1, attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


class CompiledCPUForward:
    """Called like the model: (input_ids, positions, meta, kv_caches) -> final hidden states [tokens, hidden]."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self._compiled = torch.compile(functools.partial(_body, model), fullgraph=True, dynamic=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # One graph for every token count: mark the token dimension dynamic (sizes 0/1 still specialize).
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        with cpu_attention.step_context(meta, kv_caches):
            return self._compiled(input_ids, positions)
