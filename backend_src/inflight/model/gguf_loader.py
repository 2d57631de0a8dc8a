"""Load a GGUF file (llama.cpp's format) directly: Llama and Qwen2 architectures, with their Q8_0 / Q4_0 / Q4_1
tensors kept quantized as they are (model/quant.py repacks the blocks), so no float32 copy of the model is made.

Tensors of other types (F32, F16, BF16, the K-quants, Q5_*) are dequantized by the gguf package to float32, then
quantized as the `quantization` option asks (none: they stay float32). The config comes from the file's metadata
(model/config.py reads it, RoPE scaling included). llama.cpp stores a Llama's q and k projections with each head's
rows interleaved for its RoPE; they are put back in Hugging Face's order here, as transformers' own GGUF loader does.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from .config import UnsupportedModelError, gguf_field, gguf_reader
from .quant import INT4, INT8, QuantizedEmbedding, QuantizedWeight, concat_rows, from_gguf_blocks, permute_rows, \
    quantize, quantize_int8

KEPT = ("Q8_0", "Q4_0", "Q4_1")  # repacked as they are; every other type is dequantized


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf") and os.path.isfile(path)


def _tensor(reader_tensor, quantization: str) -> QuantizedWeight | torch.Tensor:
    """One weight [out, in]: its blocks repacked where GGUF's type is kept, else float32 (quantized if asked)."""
    from gguf.quants import dequantize
    kind = reader_tensor.tensor_type.name
    inp, out = (int(x) for x in reader_tensor.shape[:2]) if len(reader_tensor.shape) > 1 else \
        (int(reader_tensor.shape[0]), 1)
    if kind in KEPT:
        return from_gguf_blocks(kind, reader_tensor.data, out, inp)
    values = torch.from_numpy(np.array(dequantize(reader_tensor.data, reader_tensor.tensor_type), dtype=np.float32))
    if len(reader_tensor.shape) == 1:
        return values.reshape(-1)
    values = values.reshape(out, inp)
    return quantize(values, quantization) if quantization in (INT8, INT4) else values


def _head_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head interleave of q / k (new row i = stored row order[i])."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _unpermute(weight, heads: int):
    order = _head_order(weight.out_features if isinstance(weight, QuantizedWeight) else weight.shape[0], heads)
    return permute_rows(weight, order) if isinstance(weight, QuantizedWeight) else weight[order]


def _fuse(parts: list, quantization: str):
    """Row-wise concatenation of projections. Parts quantized alike stay quantized; a mix (a Q4_K_M file keeps v
    at 8 bits beside 5-bit q) is dequantized and requantized as `quantization` asks (none: float32)."""
    if all(isinstance(p, QuantizedWeight) for p in parts) and \
            len({(p.kind, p.group) for p in parts}) == 1:
        return concat_rows(parts)
    values = torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts])
    return quantize(values, quantization) if quantization in (INT8, INT4) else values


def load_gguf(path: str, model, quantization: str) -> None:
    """Fill `model` (built on the meta device from config_from_gguf) from the file, in place."""
    from .linear import Linear
    reader = gguf_reader(path)
    cfg = model.cfg
    arch = gguf_field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str):
        if name not in tensors:
            raise UnsupportedModelError(f"GGUF {path}: tensor {name} is missing ({len(tensors)} tensors, e.g. "
                                        f"{sorted(tensors)[:4]})")
        return _tensor(tensors[name], quantization)

    floats: dict[str, torch.Tensor] = {"norm.weight": get("output_norm.weight")}
    linears: dict[str, object] = {}
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        floats[p + "input_layernorm.weight"] = get(b + "attn_norm.weight")
        floats[p + "post_attention_layernorm.weight"] = get(b + "ffn_norm.weight")
        q, k, v = get(b + "attn_q.weight"), get(b + "attn_k.weight"), get(b + "attn_v.weight")
        if arch == "llama":
            q, k = _unpermute(q, cfg.num_heads), _unpermute(k, cfg.num_kv_heads)
        linears[p + "self_attn.qkv_proj"] = _fuse([q, k, v], quantization)
        if cfg.qkv_bias:
            floats[p + "self_attn.qkv_proj.bias"] = torch.cat(
                [get(b + f"attn_{x}.bias") for x in "qkv"])
        linears[p + "self_attn.o_proj"] = get(b + "attn_output.weight")
        linears[p + "mlp.gate_up_proj"] = _fuse([get(b + "ffn_gate.weight"), get(b + "ffn_up.weight")], quantization)
        linears[p + "mlp.down_proj"] = get(b + "ffn_down.weight")
    embedding = get("token_embd.weight")
    head = embedding if cfg.tie_word_embeddings else get("output.weight")
    linears["lm_head"] = head

    model.load_state_dict(floats, strict=False, assign=True)
    modules = dict(model.named_modules())
    for name, weight in linears.items():
        linear: Linear = modules[name]
        if isinstance(weight, QuantizedWeight):
            linear.quant = weight
            linear.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        else:
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if isinstance(embedding, QuantizedWeight):
        model.embed_tokens = QuantizedEmbedding(embedding)
    elif quantization in (INT8, INT4):
        model.embed_tokens = QuantizedEmbedding(quantize_int8(embedding))
    else:
        model.embed_tokens.weight = torch.nn.Parameter(embedding, requires_grad=False)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise UnsupportedModelError(f"GGUF {path}: no tensor for {missing[:5]}")
