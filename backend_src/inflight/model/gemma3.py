"""Gemma 3 (text): the Llama layer's attention and MLP with Gemma's differences.

- RMSNorm scales by (1 + weight), computed in float32;
- a norm before and after both attention and MLP (four per layer), and q/k norms per head before RoPE;
- embeddings scaled by sqrt(hidden_size); attention scaled by query_pre_attn_scalar ** -0.5;
- GELU-tanh gated MLP (MLP in llama.py, by the config's hidden_act);
- sliding layers (5 of every 6 by default) see the last sliding_window positions and use their own RoPE base;
  global layers see everything (attention/ skips the blocks outside a sliding layer's window);
- optional final logit soft-capping.
"""
from __future__ import annotations

import torch
from torch import nn

from ..attention import AttentionMetadata
from .config import ModelConfig
from .linear import DirectCall
from .llama import MLP, Attention, LlamaForCausalLM, cos_sin, rope_inv_freq


class GemmaRMSNorm(DirectCall):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    qk_norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(DirectCall):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma3Attention(cfg, layer)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    norm_cls = GemmaRMSNorm
    has_llama_layers = False

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.register_buffer("local_inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        super().init_rope()
        cfg = self.cfg
        if hasattr(self, "local_inv_freq"):
            self.local_inv_freq = rope_inv_freq(cfg.head_dim, cfg.local_rope_theta or cfg.rope_theta,
                                                cfg.local_rope_scaling if cfg.local_rope_theta else cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        dtype = self.dtype
        # HF multiplies by the scale as a tensor of the weights' dtype: the same rounding here.
        x = self.embed_tokens(input_ids) * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=dtype)
        rope = {False: cos_sin(self.inv_freq, positions, dtype), True: cos_sin(self.local_inv_freq, positions, dtype)}
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = rope[bool(layer.self_attn.window)]
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
