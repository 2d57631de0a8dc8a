"""The CPU forward: llama.py's decoder layer compiled by torch's inductor, one graph shared by all layers.

Why: on a small model the eager forward spends much of a step outside the matmuls: about 35 torch calls per
layer, each with Python and dispatch costs, for norms, RoPE, SiLU-and-mul and residual adds. Inductor's C++
codegen fuses those into a few loops per layer and calls the linears (prepacked oneDNN) and the attention op
(attention/cpu.py) from one generated wrapper. Compiling one layer rather than the whole model keeps the
compile time that of one layer (the graph takes the layer's weights as inputs, so all layers reuse it).
Same modules, same weights, same math as LlamaForCausalLM.forward; only the summation order inside fused
loops can differ (within float32 rounding).

Opt-in (the engine option cpu_compile, resolved in cpu_defaults.py): off by default until it is measured faster on
a quiet machine, since each new step shape compiles a graph (seconds each, a minute cold), which the served
figures and the test suite's timings would pay. Needs a C++ compiler (inductor builds its kernels with the
system's g++); without one the runner keeps the eager forward.
"""
from __future__ import annotations

import locale
import logging

import torch

from ..attention import AttentionMetadata
from ..attention import cpu as cpu_attention
from .llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64


def _layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    attn = layer.self_attn
    q, k, v = attn.project_qkv(layer.input_layernorm(x), cos, sin)
    o = torch.ops.inflight.cpu_attention(q, k, v, attn.scale)
    x = x + attn.o_proj(o.reshape(-1, attn.q_size))
    return x + layer.mlp(layer.post_attention_layernorm(x))


# One compiled function for every layer of every model in the process: dynamo keys its cache on this code
# object and guards on tensor shapes, so layers (and models) of one shape share the graph.
_compiled_layer = torch.compile(_layer, fullgraph=True, dynamic=False)


def _utf8_file_encoding() -> None:
    """Inductor reads its code templates with open()'s default encoding. Python coerces the C locale to UTF-8
    at startup (PEP 538), but an embedded interpreter (Triton's python-backend stub) does not, so there the
    default is ASCII and the first compile fails on a non-ASCII template. Do the same coercion here."""
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    try:
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
    except locale.Error:
        log.warning("LC_CTYPE is %s and C.UTF-8 is unavailable: compiling may fail (then the forward goes eager)",
                    locale.setlocale(locale.LC_CTYPE))


class CompiledCPUForward:
    """Called like the model: (input_ids, positions, meta, kv_caches) -> final hidden states [tokens, hidden].

    If the compiler fails (no working toolchain, a torch bug), the step is rerun eagerly and the forward stays
    eager from then on: re-storing the step's K/V is harmless, the slots and values are the same."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self.is_eager = False
        _utf8_file_encoding()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if not self.is_eager:
            try:
                return self._compiled(input_ids, positions, meta, kv_caches)
            except torch._dynamo.exc.BackendCompilerFailed:
                log.exception("compiling the CPU forward failed: running eagerly from now on")
                self.is_eager = True
        return self.model(input_ids, positions, meta, kv_caches)

    def _compiled(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        model = self.model
        x = model.embed_tokens(input_ids)
        cos, sin = model.rope_cos_sin(positions)
        # One graph for every token count (a single token still gets its own, specialized one).
        for t in (x, cos, sin):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        # Each model shape in a process adds a few graphs (one and many tokens; the decode kernel per cache
        # layout), and a test process runs several models: dynamo's default limit of 8 per function is too low.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
                cpu_attention.step_context(meta, kv_caches):
            for layer in model.layers:
                x = _compiled_layer(layer, x, cos, sin)
        return model.norm(x)
