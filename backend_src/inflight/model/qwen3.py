"""Qwen3: the Llama layer with an RMSNorm over each head's q and k before RoPE (and no qkv bias, head_dim set
apart from hidden / heads, both of which the config already carries)."""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    has_llama_layers = False
