"""The architecture facts of a checkpoint, read from its config.json (transformers 4 or 5 style), for every
family the engine serves: Llama, Qwen2, Mistral, Qwen3 and Gemma 3 (model/families.py maps each to its module);
or from a GGUF file's metadata (Llama and Qwen2; model/gguf_loader.py loads its tensors). A GGUF's RoPE scaling is
read as llama.cpp reads it (linear from the metadata, Llama 3's as the rope_freqs tensor); any other kind is refused
by name.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# model_type -> the family module that builds it (model/families.py); "gemma3" is a multimodal checkpoint whose
# text part (text_config and the language model's weights) is served.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")  # general.architecture of a GGUF file
# {arch}.rope.scaling.type values served. Llama 3's scaling has no value of its own: llama.cpp's converter writes
# it as per-dimension frequency divisors, the rope_freqs tensor, which is served whatever the type says.
SUPPORTED_GGUF_ROPE_SCALING = ("none", "linear")
ROPE_FREQS = "rope_freqs.weight"
FULL, SLIDING = "full_attention", "sliding_attention"


class UnsupportedModelError(ValueError):
    """A checkpoint the engine cannot serve: the message names what was found and what is supported."""


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
    hidden_act: str = "silu"
    # Qwen3, Gemma 3: an RMSNorm over each head's q and k before RoPE.
    qk_norm: bool = False
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Per layer FULL or SLIDING; a SLIDING layer's query at position p sees keys p - sliding_window + 1 .. p.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0
    # Gemma 3: the sliding layers' own RoPE (base and scaling); 0: the same RoPE as the full layers.
    local_rope_theta: float = 0.0
    local_rope_scaling: dict = field(default_factory=dict)
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers

    @property
    def family(self) -> str:
        """The module that builds this model: llama (Llama, Qwen2, Mistral), qwen3 or gemma3."""
        return {"qwen3": "qwen3", "gemma3_text": "gemma3", "gemma3": "gemma3"}.get(self.model_type, "llama")

    def layer_window(self, layer: int) -> int:
        """Keys a query of this layer sees, itself included; 0: all before it (full attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_window(i) for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_path(cls, path: str) -> "ModelConfig":
        """From a Hugging Face folder, or a GGUF file's metadata (config_from_gguf)."""
        if str(path).endswith(".gguf"):
            return config_from_gguf(path)
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise UnsupportedModelError(f"model={path!r} has no config.json: allowed a Hugging Face model folder "
                                        f"(config.json + *.safetensors)")
        with open(config_path) as f:
            raw = json.load(f)
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model_type={model_type!r} in {config_path} is not supported: allowed "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)} (docs/models.md says how to add one)")
        text = dict(raw.get("text_config") or {}) if model_type == "gemma3" else raw
        if model_type == "gemma3":
            text.setdefault("model_type", "gemma3_text")
        cfg = _parse(model_type, text, config_path)
        cfg.eos_token_ids = _eos_ids(raw, text, path)
        return cfg


def _parse(model_type: str, raw: dict, where: str) -> ModelConfig:
    family = "gemma3" if model_type.startswith("gemma3") else model_type
    heads = raw.get("num_attention_heads", 8)
    hidden = raw.get("hidden_size", 2304 if family == "gemma3" else None)
    num_layers = raw.get("num_hidden_layers", 26 if family == "gemma3" else None)
    if hidden is None or num_layers is None:
        raise UnsupportedModelError(f"{where} lacks hidden_size or num_hidden_layers: allowed a complete "
                                    f"{model_type} config")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or ("gelu_pytorch_tanh" if family == "gemma3"
                                                                    else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act={act!r} in {where} is not supported: allowed "
                                    f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    full_rope, local_rope = _rope(raw, family, where)
    window = int(raw.get("sliding_window") or 0)
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = 0  # Qwen configs carry a sliding_window that applies only with use_sliding_window
    layer_types = _layer_types(raw, family, num_layers, window, where)
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw.get("vocab_size", 262208 if family == "gemma3" else 32000),
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_theta=full_rope.pop("rope_theta"),
        rope_scaling=full_rope if full_rope["rope_type"] != "default" else {},
        hidden_act=act,
        qk_norm=family in ("qwen3", "gemma3"),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256) if family == "gemma3" else None,
        layer_types=layer_types,
        sliding_window=window if SLIDING in layer_types else 0,
        local_rope_theta=local_rope.pop("rope_theta") if local_rope else 0.0,
        local_rope_scaling=local_rope if local_rope and local_rope["rope_type"] != "default" else {},
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _rope(raw: dict, family: str, where: str) -> tuple[dict, dict]:
    """(the full layers' RoPE, the sliding layers' RoPE or {}), each {"rope_type", "rope_theta", ...}.

    transformers 5 folds rope_theta and rope_scaling into rope_parameters, which Gemma 3 keys by layer type;
    transformers 4 has rope_theta, rope_scaling and (Gemma 3) rope_local_base_freq."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        full, local = dict(params[FULL]), dict(params.get(SLIDING) or {})
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0 if family == "gemma3" else 10000.0))
        local = {}
        if family == "gemma3":
            local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    for rope in (full, local) if local else (full,):
        rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type={rope['rope_type']!r} in {where} is not supported: allowed "
                                        f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return full, local


def _layer_types(raw: dict, family: str, num_layers: int, window: int, where: str) -> list[str]:
    types = raw.get("layer_types")
    if types:
        if len(types) != num_layers or set(types) - {FULL, SLIDING}:
            raise UnsupportedModelError(f"layer_types in {where} must list {num_layers} entries of {FULL} or "
                                        f"{SLIDING}: found {types}")
        return list(types) if window else [FULL] * num_layers
    if not window:
        return [FULL] * num_layers
    if family == "gemma3":  # every pattern-th layer is global (5 local : 1 global by default)
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if family in ("qwen2", "qwen3"):  # the window applies from max_window_layers on
        first = raw.get("max_window_layers", num_layers)
        return [SLIDING if i >= first else FULL for i in range(num_layers)]
    return [SLIDING] * num_layers  # Mistral: every layer


def _eos_ids(raw: dict, text: dict, path: str) -> list[int]:
    """eos_token_id of config.json (or its text part), then generation_config.json's, in that order."""
    eos = raw.get("eos_token_id", text.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        for e in [gen_eos] if isinstance(gen_eos, int) else (gen_eos or []):
            if e not in eos_ids:
                eos_ids.append(e)
    return eos_ids


# ---- a GGUF file ----------------------------------------------------------------------------------------------
def gguf_reader(path: str):
    """The file's reader (model/gguf_loader.py takes its tensors from the same kind)."""
    from gguf import GGUFReader  # the gguf package: only where a GGUF is read
    return GGUFReader(path)


def gguf_field(reader, key: str, default=None):
    """A metadata value of the file, or `default` where it has none."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(path: str, reader=None) -> ModelConfig:
    reader = reader or gguf_reader(path)
    arch = gguf_field(reader, "general.architecture", "")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF {path}: general.architecture={arch!r} is not supported: allowed "
                                    f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (a Hugging Face folder serves "
                                    f"more families: docs/models.md)")
    key = lambda name, default=None: gguf_field(reader, f"{arch}.{name}", default)  # noqa: E731
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    head_dim = key("attention.key_length", hidden // heads)
    return ModelConfig(
        model_type=arch, vocab_size=key("vocab_size") or (len(tokens.data) if tokens else 0), hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_layers=key("block_count"), num_heads=heads,
        num_kv_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        max_position_embeddings=key("context_length", 2048), tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, head_dim, path), eos_token_ids=_stop_token_ids(reader))


def _stop_token_ids(reader) -> list[int]:
    """EOS, then the end-of-turn token (Llama 3's <|eot_id|>, which ends every chat reply) where the file has one."""
    ids = []
    for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = gguf_field(reader, name)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _rope_scaling(reader, arch: str, head_dim: int, path: str) -> dict:
    """The RoPE scaling for model/llama.py's rope_inv_freq, with llama.cpp's reading of the file: no type means
    linear, whose factor (0 or absent: 1) divides the frequencies; type none ignores the factor; a rope_freqs
    tensor divides each frequency by its own factor, on top of the linear one."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "linear")
    if kind not in SUPPORTED_GGUF_ROPE_SCALING:
        raise UnsupportedModelError(f"GGUF {path}: {arch}.rope.scaling.type={kind!r} is not supported: allowed "
                                    f"{', '.join(SUPPORTED_GGUF_ROPE_SCALING)}, and Llama 3's scaling as a "
                                    f"rope_freqs tensor")
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor", 0.0) or
                   gguf_field(reader, f"{arch}.rope.scale_linear", 0.0) or 1.0)
    if kind == "none":
        factor = 1.0
    if factor <= 0:
        raise UnsupportedModelError(f"GGUF {path}: {arch}.rope.scaling.factor={factor} is not supported: allowed > 0")
    attn_factor = float(gguf_field(reader, f"{arch}.rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:  # llama.cpp scales cos and sin by it; rope_inv_freq has no such term
        raise UnsupportedModelError(f"GGUF {path}: {arch}.rope.scaling.attn_factor={attn_factor} is not supported: "
                                    f"allowed 1.0")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        divisors = _float_values(freqs)
        if divisors.size != head_dim // 2 or not bool((divisors > 0).all()):
            raise UnsupportedModelError(f"GGUF {path}: tensor {ROPE_FREQS} must hold {head_dim // 2} positive "
                                        f"factors (head_dim / 2): found {divisors.tolist()[:8]} "
                                        f"({divisors.size} values)")
        return {"rope_type": "freq_factors", "factors": (divisors * factor).tolist()}
    return {"rope_type": "linear", "factor": factor} if factor != 1.0 else {}


def _float_values(reader_tensor):
    """A GGUF tensor's values, flat, float32 (numpy): its type dequantized by the gguf package."""
    import numpy as np
    from gguf.quants import dequantize
    return np.array(dequantize(reader_tensor.data, reader_tensor.tensor_type), dtype=np.float32).reshape(-1)
