"""Weight-only quantized weights on CPU: int8 (per output channel, or per 32 as GGUF's Q8_0) and 4-bit (blocks of 32
with a scale and a min, GGUF's Q4_0 / Q4_1 layout); activations stay float32.

A QuantizedWeight holds the integers and scales as torch tensors, in the native product's layout: groups of 64
outputs (four tiles of 16), input by input.
Linear (model/linear.py) multiplies by it through that product (native/quant_rows.c: weights widened to float32
in registers; at a few rows bound by streaming 1/4 or ~1/7 of float32's bytes, at many by arithmetic).
`quantize_int8` / `quantize_int4` make one from a float weight at load (model parameter `quantization`);
`from_gguf_blocks` takes GGUF's Q8_0 / Q4_0 / Q4_1 blocks as they are (model/gguf_loader.py), so no float32 copy
of the model is ever made.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

INT8, INT4, BF16 = "int8", "int4", "bf16"
BLOCK = 32  # inputs per scale of a 4-bit weight, and of GGUF's Q8_0
_KINDS = {INT8: 1, INT4: 2, BF16: 3}  # native.h: Q_INT8, Q_INT4, Q_BF16


# The native layout (native.h): groups of four tiles of 16 outputs, input by input: [groups, in, 4, 16].
TILE, PER_GROUP = 16, 4
GROUP_ROWS = TILE * PER_GROUP


@dataclass
class QuantizedWeight:
    """w[o, i] = q[o, i] * scale[o, i // group] (+ min[o, i // 32] for 4-bit), in float32.

    Built from the plain layout: int8 q [out, in], group = in (per output channel) or a multiple of 32 dividing
    in; 4-bit q uint8 [out, in // 2] in GGUF's order (byte j of a 32-input block: input j in the low nibble,
    input j + 16 in the high one), scale and min [out, in // 32] (Q4_0's w = d (q - 8) as min = -8 d). Stored
    in the native product's groups of four 16-output tiles (native.h); `plain()` gives the plain layout back. bf16 (CPU
    `dtype: bfloat16`): q the weight's bfloat16 bits as int16 [out, in], no scale (group = in)."""
    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int
    in_features: int

    def __post_init__(self):
        out, inp = self.q.shape[0], self.in_features
        if self.kind == INT8 and self.group != inp and (self.group % 32 or inp % self.group):
            raise ValueError(f"int8 group={self.group} must be the row ({inp}) or a multiple of 32 that divides it")
        if self.kind == INT4 and (inp % BLOCK or self.group != BLOCK or self.min is None):
            raise ValueError(f"4-bit weights need blocks of {BLOCK} inputs with a min: in={inp}")
        if self.kind == BF16:
            self.out_features, self.q = out, _tiles(self.q).contiguous()
            self.native = _QWeight(_KINDS[BF16], inp, self.q.data_ptr(), None, None)
            return
        if self.scale.shape != (out, -(-inp // self.group)):
            raise ValueError(f"scale shape {tuple(self.scale.shape)} does not fit {out} x {inp} with group "
                             f"{self.group}")
        self.out_features = out
        values = self.q if self.kind == INT8 else _gguf_values(self.q, inp)
        tiled = _tiles(values)  # [groups, in, 4, 16]
        self.q = (tiled if self.kind == INT8 else _pack_tile_nibbles(tiled)).contiguous()
        per_output = self.kind == INT8 and self.group == inp
        self.scale = (_pad_rows(self.scale.float(), 1.0).reshape(-1) if per_output
                      else _tiles(self.scale.float())).contiguous()
        self.min = None if self.min is None else _tiles(self.min.float()).contiguous()
        # The native side reads these addresses; the struct lives as long as this weight.
        self.native = _QWeight(_KINDS[self.kind], self.group, self.q.data_ptr(), self.scale.data_ptr(),
                               None if self.min is None else self.min.data_ptr())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min) if t is not None)

    def plain(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(q, scale, min) in the layout the constructor takes."""
        out, inp = self.out_features, self.in_features
        if self.kind == BF16:
            return _untile(self.q)[:out], None, None
        if self.kind == INT8:
            per_output = self.group == inp
            scale = self.scale[:out, None] if per_output else _untile(self.scale)[:out]
            return _untile(self.q)[:out], scale, None
        values = _untile(_unpack_tile_nibbles(self.q))[:out]
        blocks = values.reshape(out, -1, BLOCK)
        packed = (blocks[..., :BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(out, -1)
        return packed, _untile(self.scale)[:out], _untile(self.min)[:out]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [out, in], or only the given rows (an embedding lookup): q * scale (+ min)."""
        rows = torch.arange(self.out_features) if rows is None else rows
        inp = self.in_features
        group, tile, lane = rows // GROUP_ROWS, rows // TILE % PER_GROUP, rows % TILE
        if self.kind == BF16:
            return self.q[group, :, tile, lane].view(torch.bfloat16).float()
        if self.kind == INT8:
            q = self.q[group, :, tile, lane].float()  # [n, in]
            if self.group == inp:
                return q * self.scale[rows, None]
            scale = self.scale[group, :, tile, lane]  # [n, groups]
            return q * scale.repeat_interleave(self.group, dim=-1)
        byte = self.q[group, :, tile, lane % (TILE // 2)]
        q = torch.where((lane < TILE // 2)[:, None], byte & 15, byte >> 4).float()
        d, m = self.scale[group, :, tile, lane], self.min[group, :, tile, lane]  # [n, blocks]
        return q * d.repeat_interleave(BLOCK, dim=-1) + m.repeat_interleave(BLOCK, dim=-1)


def _gguf_values(packed: torch.Tensor, inp: int) -> torch.Tensor:
    """GGUF-order 4-bit rows [out, in // 2] -> values [out, in] (uint8, 0-15)."""
    blocks = packed.reshape(packed.shape[0], -1, BLOCK // 2)
    return torch.cat((blocks & 15, blocks >> 4), dim=-1).reshape(packed.shape[0], inp)


def _pad_rows(t: torch.Tensor, value=0) -> torch.Tensor:
    extra = -t.shape[0] % GROUP_ROWS
    return torch.cat((t, t.new_full((extra, *t.shape[1:]), value))) if extra else t


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[out, n] -> [groups, n, 4, 16]: each group's four tiles of 16 rows, column by column (padding rows of 1: a
    harmless scale). One row's product then reads a group as one sequential stream."""
    padded = _pad_rows(t, 1 if t.is_floating_point() else 0)
    return padded.reshape(-1, PER_GROUP, TILE, t.shape[1]).permute(0, 3, 1, 2)


def _untile(t: torch.Tensor) -> torch.Tensor:
    """_tiles undone: [groups, n, 4, 16] -> [groups * 64, n]."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


def _pack_tile_nibbles(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [..., 16] per tile and input -> [..., 8] bytes, byte j holding output j in its low nibble and
    output j + 8 in its high one (native.h)."""
    return values[..., :TILE // 2] | (values[..., TILE // 2:] << 4)


def _unpack_tile_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """_pack_tile_nibbles undone."""
    return torch.cat((packed & 15, packed >> 4), dim=-1)


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


def to_bf16(weight: torch.Tensor) -> QuantizedWeight:
    """The weight rounded to bfloat16 (round to nearest even, as torch casts), kept as its bits."""
    w = weight.detach().to(torch.bfloat16).view(torch.int16)
    return QuantizedWeight(BF16, w, None, None, w.shape[1], w.shape[1])


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    return {INT8: quantize_int8, INT4: quantize_int4, BF16: to_bf16}[kind](weight)


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
    q, scale, mn = weight.plain()
    return QuantizedWeight(weight.kind, q[order], scale[order], None if mn is None else mn[order], weight.group,
                           weight.in_features)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Row-wise concatenation (q, k, v into qkv_proj; gate, up into gate_up_proj): all of one kind and group."""
    first = parts[0]
    if any((p.kind, p.group, p.in_features) != (first.kind, first.group, first.in_features) for p in parts):
        raise ValueError("fused projections must share one quantization: " +
                         ", ".join(f"{p.kind}/{p.group}" for p in parts))
    plain = [p.plain() for p in parts]
    return QuantizedWeight(first.kind, torch.cat([q for q, _, _ in plain]), torch.cat([s for _, s, _ in plain]),
                           None if first.min is None else torch.cat([m for _, _, m in plain]), first.group,
                           first.in_features)


# ---- applied to a model ---------------------------------------------------------------------------------------
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
    """Every linear of the model in place, and its embedding. With int4 the lm_head and the embedding take int8,
    as llama.cpp's 4-bit files keep them at 6-8 bits: the logits are where 4 bits cost most."""
    from .linear import Linear
    tied = model.lm_head.weight is model.embed_tokens.weight
    edge = INT8 if kind == INT4 else kind
    for name, linear in model.named_modules():
        if isinstance(linear, Linear) and linear.quant is None:
            linear.quant = quantize(linear.weight, edge if name == "lm_head" else kind)
    if tied:
        model.embed_tokens = QuantizedEmbedding(model.lm_head.quant)
    elif not isinstance(model.embed_tokens, QuantizedEmbedding):
        model.embed_tokens = QuantizedEmbedding(quantize(model.embed_tokens.weight, edge))
    release_float_weights(model)
    # The float tensors left (norms, biases) may be views of the checkpoint's memory map: copied, the map (the
    # whole float32 file) can go.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()


def release_float_weights(model: torch.nn.Module) -> None:
    """The float weight of every quantized linear, dropped: the quantized one replaces it."""
    from .linear import Linear
    for linear in model.modules():
        if isinstance(linear, Linear) and linear.quant is not None and linear.weight.numel():
            linear.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def attach_quant_product(model: torch.nn.Module) -> bool:
    """Point every quantized linear at the native product. Without a C compiler the linears dequantize at every
    call instead: correct, and slow; the caller logs it. Returns whether it is attached."""
    from .linear import Linear
    from .native_decode import quant_product
    try:
        product = quant_product()
    except (RuntimeError, OSError):
        return False
    for linear in model.modules():
        if isinstance(linear, Linear) and linear.quant is not None:
            linear.quant_product = product
    return True


def quantized_bytes(model: torch.nn.Module) -> int:
    """Bytes of the quantized weights (a shared one counted once)."""
    seen = {id(m.quant): m.quant.nbytes for m in model.modules() if getattr(m, "quant", None) is not None}
    return sum(seen.values())
