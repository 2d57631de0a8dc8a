"""nn.Linear whose CPU matmul goes through oneDNN rather than the BLAS that torch links (MKL).

Why: MKL's sgemm picks slow code paths on non-Intel CPUs (this project's 2-core AMD EPYC CI machine runs
the lm_head 2x slower through it), while oneDNN dispatches on the CPU's instruction sets. On the SmolLM2
shapes oneDNN is as fast or faster from 4 rows up (perf/bench/offline.py has the model-level figures).
The engine option cpu_gemm=blas restores torch's default; CUDA tensors never take this path.

Except at a few rows: a decode step of one to three sequences is a matrix-vector product, bound by how fast
the weights stream from memory, and there BLAS (MKL's sgemv on the dense [out, in] weight) streams at the
machine's read bandwidth while oneDNN's blocked kernels do not (SmolLM2 at one row, 2 threads, on this
project's Xeon: all linears 20 ms vs 25 ms; perf/probes/gemv_rows.py). From four rows oneDNN's prepacked GEMM is
faster (26 vs 38 ms at four, 37 vs 48 at sixteen). So float32 layers keep their dense weight beside the packed
one for up to cpu_gemv_rows rows (0 releases it). On Intel CPUs Linear takes BLAS there (default 3
rows); on others MKL takes slow code paths (1.5-2.5x oneDNN's time at one to three rows on this project's AMD
EPYC), so only the native decode step reads the dense weight, through its own product (model/native_decode.py),
which beats oneDNN up to four rows on an EPYC Zen 3 (default 4); where that step does not load, the copies are
released. The cost is memory: the linears' weights twice (425 MB for SmolLM2, whose tied lm_head is shared
anyway); where that would exceed a quarter of the memory available at load, the dense copies are released and a
warning says so. Which GEMM and how many rows are resolved per CPU in cpu_defaults.py and passed in here.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..onednn import ONEDNN_LINEAR

if TYPE_CHECKING:
    from ..cpu_defaults import ResolvedSwitches

log = logging.getLogger(__name__)


def cpu_gemm_choice() -> str:
    """onednn or blas: what an engine built now with default options would take (for benchmark reports)."""
    from ..config import EngineConfig
    from ..cpu_defaults import resolve_cpu_defaults
    return resolve_cpu_defaults(EngineConfig.from_options()).cpu_gemm


def host_defaults() -> "ResolvedSwitches":
    """The switches of a default EngineConfig on this host, no environment: for callers that load a model
    outside an engine (tests, probes)."""
    from ..config import EngineConfig
    from ..cpu_defaults import resolve_cpu_defaults
    return resolve_cpu_defaults(EngineConfig())


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Rows the packed layout is tuned for: a CPU decode batch (max_num_seqs 16 here); oneDNN stays correct,
# and near this speed, for any row count.
PACK_ROWS_HINT = 16
_PACKS: dict[torch.dtype, bool] = {}


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack and run a linear in this dtype on this CPU. bf16 needs avx512bw/vl/dq or
    avx_ne_convert (an AVX2-only CPU such as AMD's Zen 2 refuses it at the reorder); such a dtype takes BLAS."""
    if ONEDNN_LINEAR is None:
        return False
    if dtype not in _PACKS:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(3, 2, dtype=dtype), PACK_ROWS_HINT)
            ONEDNN_LINEAR(torch.ones(1, 2, dtype=dtype), packed, None, "none", [], "")
            _PACKS[dtype] = True
        except RuntimeError as exc:
            log.info("CPU linears: oneDNN cannot pack %s on this CPU (%s); %s takes BLAS", dtype,
                     str(exc).splitlines()[0], dtype)
            _PACKS[dtype] = False
    return _PACKS[dtype]


@torch.library.custom_op("inflight::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: Optional[torch.Tensor],
                  out_features: int) -> torch.Tensor:
    """The prepacked oneDNN linear as an op torch.compile treats as opaque: inductor's own lowering of the
    oneDNN op cannot take an already packed weight, so the compiled CPU forward calls it through this."""
    return ONEDNN_LINEAR(x, packed_weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


class DirectCall(nn.Module):
    """A module whose call goes straight to forward, past nn.Module's hook dispatch: a step makes ~270 module
    calls (121 of them Linear), and the dispatch was 0.7 ms of a 30 ms one-row CPU step. Nothing registers
    hooks on the engine's models."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class Linear(DirectCall, nn.Linear):
    """Drop-in nn.Linear. On CPU with oneDNN, select_cpu_gemm swaps the weight for a prepacked copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A buffer, not a plain attribute: torch.compile then takes it as an input of the graph, so one compiled
        # decoder layer serves every layer (a plain tensor attribute would be baked in, one graph per layer).
        self.register_buffer("packed_weight", None, persistent=False)
        self.gemv_rows = 0  # up to this many rows, BLAS on the dense weight even when packed (see above)
        # Or, where set, this (rows [n, in], weight, bias) -> [n, out] instead of BLAS there: the native decode
        # step's own product, for the lm_head on CPUs where MKL is slow at a few rows (model/native_decode.py).
        self.few_row_product = None
        # A weight-only quantized weight (model/quant.py) in place of `weight` (then empty), multiplied by
        # quant_product (the native product, model/native_decode.py).
        self.quant = None
        self.quant_product = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            rows = x.reshape(-1, x.shape[-1])
            if self.quant_product is None:  # no native library: correct and slow
                out = F.linear(rows, self.quant.dequantize(), self.bias)
            else:
                out = self.quant_product(rows, self.quant, self.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        if torch.compiler.is_compiling():
            out = torch.ops.inflight.onednn_linear(rows, self.packed_weight, self.bias, self.out_features)
        elif rows.shape[0] <= self.gemv_rows:
            if self.few_row_product is None:
                return F.linear(x, self.weight, self.bias)
            out = self.few_row_product(rows, self.weight, self.bias)
        else:
            out = ONEDNN_LINEAR(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def select_cpu_gemm(model: nn.Module, device: torch.device, dtype: torch.dtype,
                    switches: "ResolvedSwitches | None" = None) -> str:
    """Point every Linear of the model at oneDNN (prepacked weights) or BLAS; returns the choice, for the log.
    `switches` (cpu_defaults.py) says which GEMM and how many rows take the few-row path; None: host_defaults().

    Prepacking (reordering the weight into oneDNN's blocked layout once, at load) saves the reorder every
    call would otherwise do: 15-30% per matmul from 5 rows up. The dense weight is kept for the few-row BLAS
    path (float32, cpu_gemv_rows > 0, within the memory budget above) and otherwise released, so the
    model does not hold its weights twice, unless another module shares it (a tied lm_head).
    """
    switches = switches or host_defaults()
    use = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and switches.cpu_gemm == "onednn"
           and onednn_packs(dtype))
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quant is None]
    shared = _shared_weights(model)
    blas = switches.few_row_blas
    few_rows = switches.cpu_gemv_rows if use and dtype == torch.float32 else 0
    if few_rows:
        kept = sum(m.weight.numel() * m.weight.element_size() for m in linears if id(m.weight) not in shared)
        budget = _available_memory_bytes() // 4
        if kept > budget:
            log.warning("CPU linears: not keeping dense weights for the %d-row BLAS path: %.0f MB would exceed a "
                        "quarter of the memory available (%.0f MB); cpu_gemv_rows=0 silences this", few_rows,
                        kept / 2**20, budget / 2**20)
            few_rows = 0
    for layer in linears:
        if use and layer.packed_weight is None:
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_ROWS_HINT)
        elif not use and layer.packed_weight is not None:
            if layer.weight.numel() == 0:  # released: unpack it again
                layer.weight = nn.Parameter(layer.packed_weight.to_dense(), requires_grad=False)
            layer.packed_weight = None
        if use and not few_rows:
            _release_dense(layer, shared)
        layer.gemv_rows = few_rows if use and layer.weight.numel() and blas else 0
    return "onednn" if use else ("blas" if device.type == "cpu" else "cuda")


def release_dense_weights(model: nn.Module) -> None:
    """Drop the dense copies kept beside oneDNN's packed weights where no Linear reads them (gemv_rows 0): what
    select_cpu_gemm kept for a native decode step that then did not load."""
    shared = _shared_weights(model)
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.packed_weight is not None and not layer.gemv_rows:
            _release_dense(layer, shared)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters that modules other than Linear hold too (a tied lm_head's embedding): never released."""
    return {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}


def _release_dense(layer: Linear, shared: set[int]) -> None:
    if id(layer.weight) not in shared and layer.weight.numel():
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)
