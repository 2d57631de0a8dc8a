"""GGUF files for the tests, written with the gguf package from one of our Llama folders, as llama.cpp's converter
lays them out (q and k rows interleaved per head for its RoPE), plus the float32 folder of exactly the weights the
file holds, dequantized as the engine dequantizes them: the reference a GGUF-loaded engine must match."""
from __future__ import annotations

import json
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


def write_llama_gguf(folder: str, out: Path, qtype: str) -> tuple[Path, Path]:
    """(the GGUF, the float32 reference folder) for the Llama folder `folder`, its linears and embedding in qtype."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    out.mkdir(parents=True)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    state = load_file(str(Path(folder) / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    path = out / f"model-{qtype.lower()}.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_eos_token_id(2)
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
        blocks = quantize(w, GGMLQuantizationType[qtype])
        writer.add_tensor(theirs, blocks, raw_dtype=GGMLQuantizationType[qtype])
        dense = from_gguf_blocks(qtype, blocks, w.shape[0], w.shape[1]).dequantize()
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
