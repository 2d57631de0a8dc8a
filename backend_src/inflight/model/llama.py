"""Llama-family decoder (Llama, Qwen2, Mistral) over one flat token batch, attention through the paged cache.

The other families (qwen3.py, gemma3.py) reuse its pieces and override what differs: the layer's modules, the
norm, the embedding. A layer with a sliding window attends to the last `window` positions only.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, paged_attention, store_kv
from .config import ModelConfig
from .linear import DirectCall, Linear


def rope_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Inverse RoPE frequencies; llama3's wavelength-dependent rescaling, linear position interpolation or a
    GGUF file's per-dimension divisors (freq_factors: its rope_freqs tensor) when the scaling asks for it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin [tokens, 1, head_dim], computed in fp32 per step from the positions as HF does, then cast."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class RMSNorm(DirectCall):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [tokens, heads, head_dim] with cos/sin [tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(DirectCall):
    # A family with per-head q/k norms before RoPE (Qwen3, Gemma 3) names its norm class here.
    qk_norm_cls: type | None = None

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        if self.qk_norm_cls is not None:
            self.q_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.qk_norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: one pass over the activations instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.attention_scale
        self.window = cfg.layer_window(layer)  # 0: full attention
        self.attention_backend = "auto"  # the engine's resolved attention_backend (set_attention_backend)

    def project_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k, v [tokens, kv_heads, head_dim], RoPE applied to q and k."""
        qkv = self.qkv_proj(x)
        # q and k sit side by side in qkv, so one RoPE pass rotates both (half the ops of two passes).
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(self.norm_qk(qk), cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head q/k normalisation before RoPE, where the family has one (qk_norm_cls)."""
        if self.qk_norm_cls is None:
            return qk
        return torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.reference_plan, self.attention_backend)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.attention_backend, self.window)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(DirectCall):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(DirectCall):
    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    layer_cls = DecoderLayer
    norm_cls = RMSNorm
    # The fast paths written for this exact layer (CUDA fused ops, the compiled CPU layer, the native decode
    # step) serve a family only where its layers are this class's; model_runner.py asks before choosing one.
    has_llama_layers = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.init_rope()

    def init_rope(self) -> None:
        """The RoPE buffers, from the config: not in the checkpoint, so the loader calls this after loading."""
        self.inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights stay in it; a quantized embedding has none of its own)."""
        return self.norm.weight.dtype

    @property
    def is_quantized(self) -> bool:
        return getattr(self.lm_head, "quant", None) is not None

    @property
    def uses_fast_paths(self) -> bool:
        """Whether the fast paths written for llama.py's layer apply (see has_llama_layers): no window either."""
        return self.has_llama_layers and not self.cfg.has_sliding_layers

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(self.inv_freq, positions, self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [tokens]; returns the final hidden states [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def set_attention_backend(self, backend: str) -> None:
        """auto, triton or torch for every layer's store_kv / paged_attention (attention/__init__.py)."""
        for layer in self.layers:
            layer.self_attn.attention_backend = backend
