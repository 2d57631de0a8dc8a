"""Qwen3: the Llama layer with an RMSNorm over each head's q and k before RoPE (and no qkv bias, head_dim set
apart from hidden / heads, both of which the config already carries)."""
from __future__ import annotations

from .llama import Attention, DecoderLayer, LlamaForCausalLM, RMSNorm


class Qwen3Attention(Attention):
    qk_norm_cls = RMSNorm


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    has_llama_layers = False
