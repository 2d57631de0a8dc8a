"""The decoder forward of llama.py with its norms and MLP activation as Triton kernels (the CUDA path).

Same modules, same weights, same math as LlamaForCausalLM.forward; the residual stream is carried beside
the hidden states so each add + RMSNorm pair is one pass over memory instead of three, and SiLU-and-mul
one pass instead of three. llama.py stays the CPU path and the reference this is tested against.
"""
from __future__ import annotations

import torch

from ..attention import AttentionMetadata
from .llama import LlamaForCausalLM


def fused_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """input_ids, positions: [tokens]; returns the final hidden states [tokens, hidden]."""
    from .triton_ops import rms_norm, silu_and_mul  # triton only where this path runs

    x = model.embed_tokens(input_ids)
    cos, sin = model.rope_cos_sin(positions)
    residual = None  # None before the first layer: the embeddings are the residual stream
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
        norm = layer.input_layernorm
        h, residual = rms_norm(x, norm.weight, norm.eps, residual)
        if residual is None:
            residual = x
        h = layer.self_attn(h, cos, sin, meta, k_cache, v_cache)
        norm = layer.post_attention_layernorm
        h, residual = rms_norm(h, norm.weight, norm.eps, residual)
        x = layer.mlp.down_proj(silu_and_mul(layer.mlp.gate_up_proj(h)))
    h, _ = rms_norm(x, model.norm.weight, model.norm.eps, residual)
    return h
