"""The CPU decode step natively (native/decode_step.c): float32 decode-only steps, in one call or layer by layer.

Why: a one-row CPU step of SmolLM2 spends ~20 ms in its linears, which stream the weights at the memory's read
bandwidth, and ~10 ms in the ~40 torch calls per layer around them. decode_step.c runs a whole step (every
layer's norms, RoPE, K/V store, attention, SiLU-and-mul and residuals) as plain loops between the same BLAS
calls torch makes (MKL's sgemm, looked up in torch's own library, so threads and results are torch's), or, on
CPUs where MKL is slow at a few rows (AMD's; model/linear.py), its own few-row product over the same dense weights.

A decode-only step of at most cpu_gemv_rows rows (the rows for which the linears keep a dense weight,
model/linear.py) runs whole in one call. A larger decode-only step, where oneDNN's packed
linears are faster, runs layer by layer: torch's linears with the native pieces between them. Steps with a
prefill chunk run llama.py's forward. The engine option cpu_native_decode=false turns all of it off. The library
is compiled on first use with the system's C compiler (a fraction of a second) into a cache directory
(INFLIGHT_NATIVE_CACHE, read by env_overrides.py); with no compiler, or if
the build fails, the forward stays in torch and a warning says why. docs/cpu.md has the measurements.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import torch

from ..attention import AttentionMetadata
from ..cpu_defaults import ResolvedSwitches
from ..env_overrides import native_cache_dir
from .linear import Linear, host_defaults
from .llama import LlamaForCausalLM

log = logging.getLogger(__name__)

NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")
SOURCES = [os.path.join(NATIVE_DIR, name) for name in ("decode_step.c", "quant_rows.c")]
HEADERS = [os.path.join(NATIVE_DIR, "native.h")]
# No FMA contraction: the elementwise steps then round as torch's separate multiply and add kernels do.
# -fopenmp: attention over long contexts splits across the OpenMP team; the library then needs libgomp.so.1,
# which is the one torch has loaded (same soname), so both share one runtime and one pool of threads.
# -Wno-psabi: the 8-float vector helpers are inlined into their per-ISA clones; GCC warns about an ABI they never use.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi"]
# Weights per layer, in decode_step.c's enum order.
_PER_LAYER = 7


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in
                ("hidden", "heads", "kv_heads", "head_dim", "inter", "layers", "block_size", "table_width",
                 "threads")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("gemm", ctypes.c_void_p), ("weights", ctypes.POINTER(ctypes.c_void_p)), ("final_norm", ctypes.c_void_p),
        ("quantized", ctypes.c_int32)]


def _cache_dir() -> str:
    explicit = native_cache_dir()
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "inflight-native")


def build_library() -> str:
    """Path of the compiled library, building it if this source and these flags were not built before.
    Raises RuntimeError naming the cause when there is no compiler or the build fails."""
    source = b""
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            source += f.read()
    compiler = os.environ.get("CC") or "cc"
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode()).hexdigest()[:16]
    directory = _cache_dir()
    target = os.path.join(directory, f"decode_step-{key}.so")
    if os.path.exists(target):
        return target
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler}) on PATH")
    os.makedirs(directory, exist_ok=True)
    # Built under a temporary name and renamed: several engine processes may build at once.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        # The compiler's messages are UTF-8 (its quotes), whatever the locale: the python-backend stub's is ASCII.
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp, *SOURCES, "-lm"], capture_output=True,
                              encoding="utf-8", errors="replace")
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # mkstemp made it owner-only: an image builds it as root for another user
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _torch_sgemm() -> int:
    """Address of the Fortran-style SGEMM in torch's CPU library (MKL in x86 wheels); 0 when it has none."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = os.path.join(lib_dir, name)
        if os.path.exists(path):
            lib = ctypes.CDLL(path)  # already loaded by torch: this only looks it up
            for symbol in ("sgemm_", "SGEMM"):
                if hasattr(lib, symbol):
                    return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0
    return 0


def _load(library: str) -> ctypes.CDLL:
    """The compiled library with its functions' C signatures declared."""
    lib = ctypes.CDLL(library)
    pointer, c_int, c_float = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.decode_step.argtypes = [ctypes.POINTER(_Model), c_int] + [pointer] * 8
    lib.attention_rows.argtypes = [ctypes.POINTER(_Model), c_int] + [pointer] * 9
    lib.add_rms_norm_rows.argtypes = [c_int, pointer, pointer, pointer, c_int, c_float, pointer]
    lib.add_rms_norm_rows.restype = None
    lib.silu_mul_rows.argtypes = [c_int, pointer, c_int, pointer]
    lib.silu_mul_rows.restype = None
    lib.linear_rows.argtypes = [ctypes.POINTER(_Model), c_int, pointer, c_int, pointer, pointer, c_int, pointer]
    lib.linear_rows.restype = None
    lib.q_linear_rows.argtypes = [ctypes.POINTER(_Model), c_int, pointer, c_int, pointer, pointer, c_int, pointer]
    lib.q_linear_rows.restype = c_int
    return lib


def _linear_rows(lib: ctypes.CDLL, spec: _Model, rows: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """rows [n, in] . weight [out, in]^T (+ bias) through linear_rows(), at torch's current width."""
    rows = rows.contiguous()
    n, width = rows.shape
    out = rows.new_empty(n, weight.shape[0])
    spec.threads = torch.get_num_threads()
    lib.linear_rows(ctypes.byref(spec), n, rows.data_ptr(), width, weight.data_ptr(),
                    None if bias is None else bias.data_ptr(), weight.shape[0], out.data_ptr())
    return out


def quant_product():
    """quant_rows.c's product over a QuantizedWeight (model/quant.py), as (rows [n, in], weight, bias or None) ->
    [n, out] at torch's current width, any number of rows. Raises RuntimeError / OSError where the library
    cannot be built."""
    lib, spec = _load(build_library()), _Model(gemm=0)

    def product(rows: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        rows = rows.contiguous()
        out = rows.new_empty(rows.shape[0], weight.out_features)
        spec.threads = torch.get_num_threads()
        if lib.q_linear_rows(ctypes.byref(spec), rows.shape[0], rows.data_ptr(), rows.shape[1],
                             ctypes.byref(weight.native), None if bias is None else bias.data_ptr(),
                             weight.out_features, out.data_ptr()):
            raise MemoryError("the quantized product could not allocate its scratch memory")
        return out

    return product


def few_row_product():
    """decode_step.c's own few-row product alone, as (rows [n, in], weight [out, in], bias or None) -> [n, out]
    at torch's current width: for perf/probes/gemv_rows.py, which compares it with BLAS and oneDNN."""
    lib, spec = _load(build_library()), _Model(gemm=0)
    return lambda rows, weight, bias=None: _linear_rows(lib, spec, rows, weight, bias)


class NativeDecodeForward:
    """Called like the model: (input_ids, positions, meta, kv_caches) -> final hidden states [tokens, hidden].

    Decode-only steps of up to max_rows rows run whole in decode_step(); other decode-only steps run layer by
    layer with torch's linears (oneDNN's packed kernels there) and the native pieces between them; steps with
    a prefill chunk go to the model's own forward. max_rows is 0 where the linears keep no dense weight; gemm is
    the BLAS sgemm whole steps call, or 0 for decode_step.c's own few-row product."""

    def __init__(self, model: LlamaForCausalLM, library: str, gemm: int, max_rows: int):
        self.model = model
        cfg = model.cfg
        self.max_rows = max_rows
        self.library = library
        self.lib = _load(library)
        quantized = model.is_quantized
        weights = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            # A quantized model's linears go as QWeight descriptors (native.h), their biases as floats.
            qkv, o, gate_up, down = (lin.quant if quantized else lin.weight for lin in linears)
            weights += [layer.input_layernorm.weight, qkv, attn.qkv_proj.bias, o,
                        layer.post_attention_layernorm.weight, gate_up, down]
        weights.append(model.norm.weight)
        for w in weights:
            if w is None or not isinstance(w, torch.Tensor) or (not w.numel() and not self.max_rows):
                continue  # a QWeight, or a released dense weight (by layer only)
            if not (w.is_contiguous() and w.dtype == torch.float32 and w.numel()):
                raise RuntimeError("the native decode step needs contiguous float32 weights")
        self._weights = weights  # held: the native side keeps their addresses
        ptrs = [0 if w is None else w.data_ptr() if isinstance(w, torch.Tensor) else ctypes.addressof(w.native)
                for w in weights]
        self._norms = [(ptrs[i], ptrs[i + 4]) for i in range(0, len(ptrs) - 1, 7)]  # (input, post-attention)
        self._weight_ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.spec = _Model(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, inter=cfg.intermediate_size, layers=cfg.num_layers,
                           eps=cfg.rms_norm_eps, scale=model.layers[0].self_attn.scale, gemm=gemm,
                           weights=ctypes.cast(self._weight_ptrs, ctypes.POINTER(ctypes.c_void_p)),
                           final_norm=ptrs[-1], quantized=int(quantized))
        self._spec_ref = ctypes.byref(self.spec)
        self._cache_key: list = []
        self._cache_arrays = None
        self.steps = 0  # whole-step native calls, for tests and the log
        self.layered_steps = 0  # decode steps run layer by layer

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows [n, in] . weight [out, in]^T (+ bias) as the step's linears run: decode_step.c's own few-row
        product, or the BLAS sgemm where one was given. Float32, contiguous weight and bias."""
        return _linear_rows(self.lib, self.spec, rows, weight, bias)

    def _cache_pointers(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Each layer's K and V cache address, as two C arrays; rebuilt only when the cache list changes."""
        key = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        if key != self._cache_key:
            for k, v in kv_caches:
                for cache in (k, v):
                    if not (cache.is_contiguous() and cache.dtype == torch.float32 and cache.dim() == 4):
                        raise ValueError("the native decode step needs contiguous float32 caches "
                                         "[blocks, block_size, kv_heads, head_dim]")
            array = ctypes.c_void_p * len(kv_caches)
            self._cache_arrays = (array(*[k for k, _ in key]), array(*[v for _, v in key]))
            self._cache_key = key
        return self._cache_arrays

    def covers(self, meta: AttentionMetadata) -> str | None:
        """'step' (one native call), 'layers' (native pieces between torch's linears) or None (the model)."""
        if meta.max_query_len != 1:
            return None
        return "step" if meta.num_seqs <= self.max_rows else "layers"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        how = self.covers(meta)
        if how is None:
            return self.model(input_ids, positions, meta, kv_caches)
        model, spec = self.model, self.spec
        x = model.embed_tokens(input_ids).contiguous()
        cos, sin = model.rope_cos_sin(positions)
        cos, sin = cos.contiguous(), sin.contiguous()
        k_ptrs, v_ptrs = self._cache_pointers(kv_caches)
        spec.block_size, spec.table_width = kv_caches[0][0].shape[1], meta.block_tables.shape[1]
        spec.threads = torch.get_num_threads()
        tables = meta.block_tables.to(torch.int32).contiguous()  # no copy when already so (the usual case)
        lens = meta.seq_lens.to(torch.int32).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = (cos.data_ptr(), sin.data_ptr())
        rows = (slots.data_ptr(), tables.data_ptr(), lens.data_ptr())
        if how == "step":
            rc = self.lib.decode_step(self._spec_ref, x.shape[0], x.data_ptr(), *step, k_ptrs, v_ptrs, *rows)
            self.steps += 1
        else:
            rc = self._by_layer(x, step, rows, k_ptrs, v_ptrs)
            self.layered_steps += 1
        if rc != 0:
            raise MemoryError("the native decode step could not allocate its scratch memory")
        return x

    def _by_layer(self, x: torch.Tensor, step, rows, k_ptrs, v_ptrs) -> int:
        """The layers with torch's linears; x becomes the final hidden states. Returns decode_step()'s code."""
        lib, cfg, n = self.lib, self.model.cfg, x.shape[0]
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        h = torch.empty_like(x)
        att = x.new_empty(n, cfg.num_heads * cfg.head_dim)
        act = x.new_empty(n, cfg.intermediate_size)
        xp, hp, attp, actp = x.data_ptr(), h.data_ptr(), att.data_ptr(), act.data_ptr()
        added = None  # the last down projection, added to the residual stream by the next norm
        for i, layer in enumerate(self.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            in_norm, post_norm = self._norms[i]
            lib.add_rms_norm_rows(n, xp, None if added is None else added.data_ptr(), in_norm, hidden, eps, hp)
            qkv = attn.qkv_proj(h)
            rc = lib.attention_rows(self._spec_ref, n, qkv.data_ptr(), *step, k_ptrs[i], v_ptrs[i], *rows, attp)
            if rc != 0:
                return rc
            # Each linear's output is held in a name until its call returns: a temporary would be freed (and its
            # memory reused) before the native side reads it.
            o = attn.o_proj(att)
            lib.add_rms_norm_rows(n, xp, o.data_ptr(), post_norm, hidden, eps, hp)
            gate_up = mlp.gate_up_proj(h)
            lib.silu_mul_rows(n, gate_up.data_ptr(), cfg.intermediate_size, actp)
            added = mlp.down_proj(act)
        lib.add_rms_norm_rows(n, xp, added.data_ptr(), self.spec.final_norm, hidden, eps, hp)
        x.copy_(h)
        return 0


def _linears(model: LlamaForCausalLM):
    for layer in model.layers:
        yield from (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def native_few_row_linears(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                           switches: ResolvedSwitches | None = None) -> bool:
    """For a model whose layers the whole native step does not cover (another family, a sliding window): its
    linears at up to cpu_gemv_rows rows through decode_step.c's own product on their dense weights, where Linear
    does not take BLAS there (not Intel). The lm_head is most of a small model's bytes (Gemma 3 270M: 671 of
    1,070 MB), and oneDNN streams it at ~18 GB/s where the product reaches ~25. Returns whether it did."""
    switches = switches or host_defaults()
    rows = switches.cpu_gemv_rows
    if device.type != "cpu" or dtype != torch.float32 or not switches.cpu_native_decode or switches.few_row_blas \
            or not rows or sys.platform != "linux":
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None
               and m.weight.numel() and m.weight.is_contiguous() and m.weight.dtype == torch.float32]
    if not linears:
        return False
    try:
        lib = _load(build_library())
    except (RuntimeError, OSError) as exc:
        log.warning("native few-row product unavailable (%s): linears stay in torch", exc)
        return False
    spec = _Model(gemm=0)
    for linear in linears:
        linear.gemv_rows = rows
        linear.few_row_product = lambda x, weight, bias: _linear_rows(lib, spec, x, weight, bias)
    log.info("native few-row product: %d linears up to %d rows (the rest of the forward in torch)", len(linears),
             rows)
    return True


def native_forward(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                   switches: ResolvedSwitches | None = None):
    """A NativeDecodeForward for this model where the native step applies and builds, else None (and why, in
    the log at info or warning level). `switches` (cpu_defaults.py): whether it is on, its row limit and whether
    Linear takes BLAS at a few rows; None: host_defaults()."""
    switches = switches or host_defaults()
    if device.type != "cpu" or dtype != torch.float32 or not switches.cpu_native_decode:
        return None
    if sys.platform != "linux":
        log.info("native CPU decode step: not on %s", sys.platform)
        return None
    # Whole steps need the dense weights that select_cpu_gemm keeps for the few-row path (model/linear.py), and
    # torch's sgemm where Linear takes BLAS there too (Intel), else decode_step.c's own product. A quantized
    # model's decode steps run whole at any size, through the quantized product its linears use anyway.
    if model.is_quantized:
        if not all(layer.quant is not None for layer in _linears(model)):
            log.info("native CPU decode step: not for a model with float and quantized linears mixed")
            return None
        max_rows, gemm = 1 << 30, 0
    else:
        max_rows = switches.cpu_gemv_rows if all(layer.weight.numel() for layer in _linears(model)) else 0
        gemm = _torch_sgemm() if max_rows and switches.few_row_blas else 0
    try:
        # Loading can fail too: a cache directory on a noexec mount, a foreign file under the library's name.
        forward = NativeDecodeForward(model, build_library(), gemm, max_rows)
    except (RuntimeError, OSError) as exc:
        log.warning("native CPU decode step unavailable (%s): decode steps stay in torch (slower); "
                    "cpu_native_decode=false (or INFLIGHT_CPU_NATIVE=0) silences this", exc)
        return None
    head = model.lm_head
    if max_rows and not gemm and not model.is_quantized and head.weight.numel() and head.weight.is_contiguous() \
            and head.weight.dtype == torch.float32:
        # The logits of those steps too: oneDNN streams the lm_head's 113 MB (SmolLM2) at ~18 GB/s where the
        # native product reaches ~25 (6.2 vs 4.4 ms a one-row step on this project's EPYC).
        head.gemv_rows, head.few_row_product = max_rows, forward.linear
    if model.is_quantized:
        log.info("native CPU decode step (%s): every decode step whole, quantized weights", forward.library)
    else:
        log.info("native CPU decode step (%s): whole steps up to %d rows (%s), layer by layer above",
                 forward.library, forward.max_rows, "BLAS" if gemm else "its own product")
    return forward


def main() -> None:
    """Build the library ahead of time, e.g. in an image whose runtime has no compiler:
    INFLIGHT_NATIVE_CACHE=/opt/native python -m inflight.model.native_decode, and the same variable at run time."""
    print(build_library())


if __name__ == "__main__":
    main()
