"""GGUF files for the tests, written with the gguf package from one of our Llama folders, as llama.cpp's converter
lays them out (q and k rows interleaved per head for its RoPE), plus the float32 folder of exactly the weights the
file holds, dequantized as the engine dequantizes them: the reference a GGUF-loaded engine must match. A RoPE
scaling goes into the file as llama.cpp's converter writes it (llama3: a rope_freqs tensor; linear, yarn: metadata)
and into the reference folder's config.json as transformers reads it."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from inflight.model.quant import from_gguf_blocks

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a q / k projection's rows (convert_hf_to_gguf.py's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _deinterleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The per-dimension divisors of the base frequencies that Llama 3's RoPE scaling amounts to, as llama.cpp's
    converter stores them in rope_freqs: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            divisors.append(1.0)
        elif wavelen > old_len / low:
            divisors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _add_rope_scaling(writer, scaling: dict, theta: float, head_dim: int, context: int) -> None:
    from gguf import RopeScalingType
    kind = scaling["rope_type"]
    if kind == "llama3":  # llama.cpp's converter writes no scaling keys for it, only the factors
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, theta, scaling))
        return
    writer.add_rope_scaling_type(RopeScalingType(kind))
    writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind != "linear":
        writer.add_rope_scaling_orig_ctx_len(int(scaling.get("original_max_position_embeddings", context)))


def _stored(w: np.ndarray, qtype: str) -> tuple[np.ndarray, torch.Tensor]:
    """(what the file holds, the float32 weight the engine will compute with)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    if qtype == "F32":
        return w, torch.from_numpy(w.copy())
    blocks = quantize(w, GGMLQuantizationType[qtype])
    return blocks, from_gguf_blocks(qtype, blocks, w.shape[0], w.shape[1]).dequantize()


def write_llama_gguf(folder: str, out: Path, qtype: str, rope_scaling: dict | None = None,
                     eot_token_id: int | None = None) -> tuple[Path, Path]:
    """(the GGUF, the float32 reference folder) for the Llama folder `folder`, its linears and embedding in qtype
    (F32: as they are). rope_scaling: transformers' {"rope_type": "llama3" | "linear" | "yarn", ...}."""
    from gguf import GGMLQuantizationType, GGUFWriter
    out.mkdir(parents=True)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    state = load_file(str(Path(folder) / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    path = out / f"model-{qtype.lower()}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_eos_token_id(2)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    if rope_scaling:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        _add_rope_scaling(writer, rope_scaling, theta, head_dim, cfg["max_position_embeddings"])
        cfg.pop("rope_scaling", None)
        cfg["rope_parameters"] = {"rope_theta": theta, **rope_scaling}
    reference = {}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names.update({p + "input_layernorm.weight": b + "attn_norm.weight",
                      p + "post_attention_layernorm.weight": b + "ffn_norm.weight",
                      p + "self_attn.q_proj.weight": b + "attn_q.weight",
                      p + "self_attn.k_proj.weight": b + "attn_k.weight",
                      p + "self_attn.v_proj.weight": b + "attn_v.weight",
                      p + "self_attn.o_proj.weight": b + "attn_output.weight",
                      p + "mlp.gate_proj.weight": b + "ffn_gate.weight", p + "mlp.up_proj.weight": b + "ffn_up.weight",
                      p + "mlp.down_proj.weight": b + "ffn_down.weight"})
    for ours, theirs in names.items():
        w = state[ours].float().numpy()
        if w.ndim == 1:
            writer.add_tensor(theirs, w)
            reference[ours] = torch.from_numpy(w.copy())
            continue
        if ".attn_q." in theirs or ".attn_k." in theirs:
            w = _interleave(w, heads if ".attn_q." in theirs else kv_heads)
        blocks, dense = _stored(w, qtype)
        writer.add_tensor(theirs, blocks, raw_dtype=GGMLQuantizationType[qtype])
        if ".attn_q." in theirs or ".attn_k." in theirs:
            dense = _deinterleave(dense, heads if ".attn_q." in theirs else kv_heads)
        reference[ours] = dense
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref_dir = out / "dequantized"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in reference.items()}, str(ref_dir / "model.safetensors"),
              metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        for dest in (out, ref_dir):
            if (Path(folder) / name).is_file():
                shutil.copy2(Path(folder) / name, dest / name)
    return path, ref_dir
