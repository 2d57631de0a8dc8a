"""Weight-only quantized weights on CPU: int8 (per output channel, or per 32 as GGUF's Q8_0) and 4-bit (blocks of 32
with a scale and a min, GGUF's Q4_0 / Q4_1 layout); activations stay float32.

A QuantizedWeight holds the integers and scales as torch tensors. Linear (model/linear.py) multiplies by it at a
few rows through the native product (native/quant_rows.c: each weight widened to float32 in registers, 1/4 or
~1/7 of float32's bytes streamed), and at more rows by dequantizing chunks into float32 for oneDNN, where the step
is bound by arithmetic rather than by bytes. `quantize_int8` / `quantize_int4` make one from a float weight at
load (model parameter `quantization`); `from_gguf_blocks` repacks GGUF's Q8_0 / Q4_0 / Q4_1 blocks as they are
(model/gguf_loader.py), so no float32 copy of the model is ever made.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

INT8, INT4 = "int8", "int4"
BLOCK = 32  # inputs per scale of a 4-bit weight, and of GGUF's Q8_0
_KINDS = {INT8: 1, INT4: 2}  # native.h: Q_INT8, Q_INT4


@dataclass
class QuantizedWeight:
    """w[o, i] = q[o, i] * scale[o, i // group] (+ min[o, i // 32] for 4-bit), in float32 (the native product
    applies the scales per group: native/quant_rows.c).

    int8: q int8 [out, in]; group = in (per output channel) or a multiple of 32. 4-bit: q uint8 [out, in // 2] in
    GGUF's order (byte j of a 32-input block: input j in the low nibble, input j + 16 in the high one); scale and
    min [out, in // 32]; Q4_0's w = d (q - 8) is stored as min = -8 d."""
    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int
    in_features: int

    def __post_init__(self):
        self.scale = self.scale.float().contiguous()
        self.min = None if self.min is None else self.min.float().contiguous()
        self.q = self.q.contiguous()
        out = self.q.shape[0]
        if self.kind == INT8 and self.group != self.in_features and (self.group % 32 or self.in_features % self.group):
            raise ValueError(f"int8 group={self.group} must be the row ({self.in_features}) or a multiple of 32 "
                             f"that divides it")
        if self.kind == INT4 and (self.in_features % BLOCK or self.group != BLOCK or self.min is None):
            raise ValueError(f"4-bit weights need blocks of {BLOCK} inputs with a min: in={self.in_features}")
        if self.scale.shape != (out, -(-self.in_features // self.group)):
            raise ValueError(f"scale shape {tuple(self.scale.shape)} does not fit {out} x {self.in_features} "
                             f"with group {self.group}")
        # The native side reads these addresses; the struct lives as long as this weight.
        self.native = _QWeight(_KINDS[self.kind], self.group, self.q.data_ptr(), self.scale.data_ptr(),
                               None if self.min is None else self.min.data_ptr())

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [out, in], or only the given rows (an embedding lookup), rounded as the native
        product rounds each weight: q * scale, then + min."""
        q, scale = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        if self.kind == INT8:
            per = scale.repeat_interleave(self.group, dim=-1)[..., :self.in_features]
            return q.float() * per
        mn = self.min if rows is None else self.min[rows]
        blocks = q.reshape(*q.shape[:-1], -1, BLOCK // 2)
        values = torch.cat((blocks & 15, blocks >> 4), dim=-1).float()  # [..., blocks, 32]
        return (values * scale[..., None] + mn[..., None]).reshape(*q.shape[:-1], self.in_features)


class _QWeight(ctypes.Structure):
    """native.h's QWeight."""
    _fields_ = [("kind", ctypes.c_int32), ("group", ctypes.c_int32), ("q", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("min", ctypes.c_void_p)]


def quantize_int8(weight: torch.Tensor, group: int | None = None) -> QuantizedWeight:
    """Symmetric int8, one scale per output channel (group None) or per `group` inputs: scale = absmax / 127."""
    w = weight.detach().float()
    out, inp = w.shape
    group = group or inp
    padded = torch.nn.functional.pad(w, (0, -inp % group)).reshape(out, -1, group)
    scale = padded.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(padded / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(out, -1)[:, :inp]
    return QuantizedWeight(INT8, q, scale, None, group, inp)


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric 4-bit in blocks of 32 (GGUF's Q4_1 rule): d = (max - min) / 15, q = round((w - min) / d)."""
    w = weight.detach().float()
    out, inp = w.shape
    if inp % BLOCK:
        raise ValueError(f"4-bit quantization needs in_features divisible by {BLOCK}: {inp}")
    blocks = w.reshape(out, -1, BLOCK)
    lo, hi = blocks.amin(dim=-1), blocks.amax(dim=-1)
    d = (hi - lo) / 15.0
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((blocks - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)  # input j low, input j + 16 high
    return QuantizedWeight(INT4, packed.reshape(out, inp // 2), d, lo, BLOCK, inp)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    return quantize_int8(weight) if kind == INT8 else quantize_int4(weight)


# GGUF block layouts (ggml-common.h): Q8_0 = fp16 d + 32 int8; Q4_0 = fp16 d + 16 bytes; Q4_1 = fp16 d, fp16 m + 16.
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def from_gguf_blocks(kind: str, raw: np.ndarray, out: int, inp: int) -> QuantizedWeight:
    """A GGUF tensor's blocks ([out, in / 32 * block bytes] uint8, as the gguf reader gives them) repacked as is."""
    if inp % BLOCK:
        raise ValueError(f"GGUF {kind} rows of {inp} inputs are not whole blocks of {BLOCK}")
    blocks = np.ascontiguousarray(raw).reshape(out, inp // BLOCK, GGUF_BLOCK_BYTES[kind])
    d = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(out, inp))
        return QuantizedWeight(INT8, q, d, None, BLOCK, inp)
    if kind == "Q4_0":
        q = torch.from_numpy(blocks[..., 2:].copy().reshape(out, inp // 2))
        return QuantizedWeight(INT4, q, d, -8.0 * d, BLOCK, inp)
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    q = torch.from_numpy(blocks[..., 4:].copy().reshape(out, inp // 2))
    return QuantizedWeight(INT4, q, d, m, BLOCK, inp)


def permute_rows(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """The same weight with its output rows reordered (undoing llama.cpp's q/k row interleave)."""
    return QuantizedWeight(weight.kind, weight.q[order], weight.scale[order],
                           None if weight.min is None else weight.min[order], weight.group, weight.in_features)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-wise concatenation (q, k, v into qkv_proj; gate, up into gate_up_proj): all of one kind and group."""
    first = parts[0]
    if any((p.kind, p.group, p.in_features) != (first.kind, first.group, first.in_features) for p in parts):
        raise ValueError("fused projections must share one quantization: " +
                         ", ".join(f"{p.kind}/{p.group}" for p in parts))
    return QuantizedWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           None if first.min is None else torch.cat([p.min for p in parts]), first.group,
                           first.in_features)


# ---- applied to a model ---------------------------------------------------------------------------------------
# Up to this many rows a quantized linear takes the native product; above, its weight is dequantized for oneDNN /
# BLAS (perf/probes/quant_rows.py measures the crossing: the native product's arithmetic grows with the rows while
# a dequantization costs one pass over the weight).
QUANT_ROWS = 16


# A many-row product dequantizes this many float32 weights at a time (4 MB: cache-resident while multiplied), so its
# scratch memory stays small whatever the matrix (SmolLM2's lm_head would be 113 MB at once).
DEQUANT_CHUNK_FLOATS = 1 << 20


def many_rows_product(rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, product,
                      gemm) -> torch.Tensor:
    """rows [n, in] . weight^T for many rows: output-row chunks of the weight dequantized natively into the
    product's scratch buffer, each multiplied by `gemm(x, w, bias)` (oneDNN or torch's linear)."""
    chunk = max(1, DEQUANT_CHUNK_FLOATS // weight.in_features)
    scratch = product.scratch(chunk * weight.in_features)
    outs = []
    for o0 in range(0, weight.out_features, chunk):
        o1 = min(weight.out_features, o0 + chunk)
        outs.append(gemm(rows, product.dequantize(weight, o0, o1, scratch), None if bias is None else bias[o0:o1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


class QuantizedEmbedding(torch.nn.Module):
    """An embedding whose rows are dequantized on lookup (a tied one shares the lm_head's quantized weight)."""

    def __init__(self, quant: QuantizedWeight):
        super().__init__()
        self.quant = quant

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quant.dequantize(input_ids)


def quantize_model(model: torch.nn.Module, kind: str) -> None:
    """Every linear of the model in place, and its embedding. The lm_head and the embedding take int8 whatever
    `kind` is, as llama.cpp's 4-bit files keep them at 6-8 bits: the logits are where 4 bits cost most."""
    from .linear import Linear
    tied = model.lm_head.weight is model.embed_tokens.weight
    for name, linear in model.named_modules():
        if isinstance(linear, Linear) and linear.quant is None:
            linear.quant = quantize(linear.weight, INT8 if name == "lm_head" else kind)
    if tied:
        model.embed_tokens = QuantizedEmbedding(model.lm_head.quant)
    elif not isinstance(model.embed_tokens, QuantizedEmbedding):
        model.embed_tokens = QuantizedEmbedding(quantize_int8(model.embed_tokens.weight))
    release_float_weights(model)


def release_float_weights(model: torch.nn.Module) -> None:
    """The float weight of every quantized linear, dropped: the quantized one replaces it."""
    from .linear import Linear
    for linear in model.modules():
        if isinstance(linear, Linear) and linear.quant is not None and linear.weight.numel():
            linear.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def attach_quant_product(model: torch.nn.Module, rows: int = QUANT_ROWS) -> bool:
    """Point every quantized linear at the native product (up to `rows` rows). Without a C compiler the linears
    dequantize at every call instead: correct, and slow; the caller logs it. Returns whether it is attached."""
    from .linear import Linear
    from .native_decode import quant_product
    try:
        product = quant_product()
    except (RuntimeError, OSError):
        return False
    for linear in model.modules():
        if isinstance(linear, Linear) and linear.quant is not None:
            linear.quant_product, linear.quant_rows = product, rows
    return True


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantized weights (a shared one counted once)."""
    seen = {id(m.quant): m.quant.nbytes for m in model.modules() if getattr(m, "quant", None) is not None}
    return sum(seen.values())
