"""Load an HF folder (config.json + *.safetensors) into our fused-projection module of its family."""
from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from .config import ModelConfig, UnsupportedModelError, config_from_gguf
from .families import model_class
from .gguf_loader import is_gguf, load_gguf
from .linear import select_cpu_gemm
from .llama import LlamaForCausalLM
from .quant import quantize_model

# Checkpoint projections that our module holds fused: (ours, [theirs in concatenation order]).
_FUSED = [
    ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
    ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
]
# Where a checkpoint keeps the decoder (stripped), lm_head aside: a multimodal Gemma 3 nests its text model
# (transformers 4: language_model.model.*, 5: model.language_model.*); its vision tower is not loaded.
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise UnsupportedModelError(f"model={path!r} has no *.safetensors: allowed a Hugging Face folder with "
                                    f"safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_model(path: str, dtype: torch.dtype, device: str | torch.device, switches=None,
               quantization: str = "none") -> LlamaForCausalLM:
    """switches: the engine's resolved switches (cpu_defaults.py) for the CPU linears; None: this host's
    defaults. quantization: none, int8 or int4 (weight-only, CPU: model/quant.py)."""
    if is_gguf(path):
        return _load_gguf(path, dtype, device, switches, quantization)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    ckpt = _read_checkpoint(path)
    state = {}
    for name, tensor in ckpt.items():
        if "rotary_emb" in name or name.startswith(_SKIPPED):
            continue
        if name.endswith("lm_head.weight"):
            state["lm_head.weight"] = tensor
            continue
        state[next((name.removeprefix(p) for p in _PREFIXES if name.startswith(p)), name)] = tensor
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        for ours, theirs in _FUSED:
            for suffix in ("weight", "bias"):
                parts = [f"{prefix}{t}.{suffix}" for t in theirs]
                if all(p in state for p in parts):
                    state[f"{prefix}{ours}.{suffix}"] = torch.cat([state.pop(p) for p in parts], dim=0)
    if (cfg.tie_word_embeddings or "lm_head.weight" not in state) and "embed_tokens.weight" in state:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = {k for k in model.state_dict()}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise UnsupportedModelError(
            f"checkpoint {path} does not match its config's architecture ({cfg.model_type}, {cfg.num_layers} "
            f"layers): {len(missing)} weights missing {sorted(missing)[:5]}, {len(unexpected)} unexpected "
            f"{sorted(unexpected)[:5]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()  # buffers are not in the checkpoint; meta init left them empty
    model = model.to(device).eval()
    if quantization != "none":
        quantize_model(model, quantization)
    select_cpu_gemm(model, torch.device(device), dtype, switches)
    return model


def _load_gguf(path: str, dtype: torch.dtype, device, switches, quantization: str) -> LlamaForCausalLM:
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        raise UnsupportedModelError(f"a GGUF model ({path}) is served on CPU in float32: allowed dtype float32 or "
                                    f"auto with device cpu")
    cfg = config_from_gguf(path)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    load_gguf(path, model, quantization)
    model.init_rope()
    model = model.eval()
    select_cpu_gemm(model, torch.device(device), dtype, switches)
    return model
