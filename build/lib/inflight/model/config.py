"""The architecture facts of a Llama-family checkpoint, read from its config.json (transformers 4 or 5 style)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", ...} or {}
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} in {path} is not supported: "
                             f"allowed {', '.join(SUPPORTED_MODEL_TYPES)}")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_type={rope_type!r} is not supported: allowed default, llama3")
        rope["rope_type"] = rope_type
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen_eos = json.load(f).get("eos_token_id")
            for e in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
                if e not in eos_ids:
                    eos_ids.append(e)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else {},
            eos_token_ids=eos_ids,
        )
