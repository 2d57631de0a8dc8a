"""Load an HF folder (config.json + *.safetensors) into our fused-projection Llama module."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from .config import ModelConfig
from .linear import select_cpu_gemm
from .llama import LlamaForCausalLM, rope_inv_freq

# Checkpoint projections that our module holds fused: (ours, [theirs in concatenation order]).
_FUSED = [
    ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
]


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(path: str, dtype: torch.dtype, device: str | torch.device, switches=None) -> LlamaForCausalLM:
    """switches: the engine's resolved switches (cpu_defaults.py) for the CPU linears; None: this host's
    defaults."""
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ckpt = _read_checkpoint(path)
    state = {}
    for name, tensor in ckpt.items():
        if "rotary_emb" in name:
            continue
        state[name.removeprefix("model.")] = tensor
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        for ours, theirs in _FUSED:
            for suffix in ("weight", "bias"):
                parts = [f"{prefix}{t}.{suffix}" for t in theirs]
                if all(p in state for p in parts):
                    state[f"{prefix}{ours}.{suffix}"] = torch.cat([state.pop(p) for p in parts], dim=0)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = {k for k in model.state_dict()}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the architecture: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)  # buffers are not in the checkpoint; meta init left it empty
    model = model.to(device).eval()
    select_cpu_gemm(model, torch.device(device), dtype, switches)
    return model
