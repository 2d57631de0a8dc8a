"""Engine configuration: one dataclass, parsed from keyword options or Triton config.pbtxt parameters."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .fields import parse_bool


@dataclass
class EngineConfig:
    model: str = ""
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: derive from kv_cache_memory_bytes (CPU) or gpu_memory_utilization (CUDA)
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    # CUDA: this engine's share of the whole device's memory for weights + activations + KV cache; the KV cache
    # gets what a warm-up forward of max_num_batched_tokens leaves. Engines on one device need shares that add up
    # to what it can give, e.g. 0.45 each for two (see kv_sizing.py).
    gpu_memory_utilization: float = 0.9
    # CUDA: True runs decode steps eagerly instead of replaying CUDA graphs (CPU is always eager).
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Static batching (the dynamic-batcher arm): admit a batch only when none runs, never mid-batch,
    # so finished requests leave their slot idle until the longest one ends.
    static_batching: bool = False
    fast_lane_share: float = 0.25  # share of each step's token budget kept for the fast lane
    fast_lane_max_prompt_tokens: int = 64  # "short" prompt for the fast lane
    fast_lane_max_tokens: int = 32  # "small" max_tokens for the fast lane
    watermark: float = 0.02  # fraction of blocks kept free at admission, against thrashing
    max_queue_size: int = 256  # waiting requests beyond this are refused (Triton glue)
    max_prompt_bytes: int = 1 << 20  # prompt text beyond this is refused before tokenizing (see prompt.py)
    default_max_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            ("block_size", self.block_size, 1, 1024),
            ("max_num_seqs", self.max_num_seqs, 1, 1 << 20),
            ("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 24),
            ("max_model_len", self.max_model_len, 1, 1 << 24),
            ("num_kv_blocks", self.num_kv_blocks, 0, 1 << 30),
            ("max_queue_size", self.max_queue_size, 1, 1 << 30),
            ("default_max_tokens", self.default_max_tokens, 1, 1 << 24),
            ("max_prompt_bytes", self.max_prompt_bytes, 1, 1 << 40),
        ]
        for name, value, lo, hi in checks:
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{name}={value!r} is out of range: allowed integers in [{lo}, {hi}]")
        for name, value in (("fast_lane_share", self.fast_lane_share), ("watermark", self.watermark)):
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(f"{name}={value!r} is out of range: allowed [0, 1)")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} is out of range: "
                             f"allowed (0, 1]")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is not allowed: auto, float32, float16, bfloat16")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_model_len="
                f"{self.max_model_len} when chunked prefill is disabled")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """Build from keyword options; unknown names raise, strings are converted to the field's type."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
        kwargs = {}
        for name, raw in options.items():
            default = getattr(cls, name)
            kwargs[name] = _convert(name, raw, type(default))
        return cls(**kwargs)


def _convert(name: str, raw, kind: type):
    if not isinstance(raw, str):
        return kind(raw) if kind is float and isinstance(raw, int) else raw
    text = raw.strip()
    try:
        if kind is bool:
            flag = parse_bool(text)
            if flag is None:
                raise ValueError
            return flag
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(f"engine option {name}={raw!r} is malformed: expected {kind.__name__}") from None
    return text
