"""Probe: up to how many rows does BLAS (or the native product) beat oneDNN? (the cpu_gemv_rows defaults)

Milliseconds for all of a model's linears at a few row counts, BLAS (MKL sgemv/sgemm on the dense weight)
against oneDNN (prepacked weight) and the native decode step's own product (decode_step.c, on the dense weight):
the measurement behind INFLIGHT_CPU_GEMV_ROWS's defaults (model/linear.py): BLAS's limit on Intel CPUs, the
native product's elsewhere.

    .venv/bin/python -m perf.probes.gemv_rows
    OMP_NUM_THREADS=1 .venv/bin/python -m perf.probes.gemv_rows --rows 1,2,3,4,16

Random float32 weights of the model's shapes (q/k/v and gate/up fused as the engine loads them), every layer
its own weight so they stream from memory as in a real step; median of --repeats passes over all of them.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import inflight  # noqa: F401, I001 - first: it sets the OpenMP wait policy before torch loads OpenMP, as served
import torch
import torch.nn.functional as F

from inflight.model.config import ModelConfig
from inflight.model.linear import PACK_ROWS_HINT
from inflight.model.native_decode import few_row_product
from inflight.onednn import ONEDNN_LINEAR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every linear of the decoder, then the lm_head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
             (cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if ONEDNN_LINEAR is None:
        raise SystemExit("this torch build has no oneDNN linear: there is nothing to compare")
    shapes = model_shapes(ModelConfig.from_dir(args.model))
    dense = [torch.randn(out_f, in_f) for out_f, in_f in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in dense]
    native = few_row_product()
    megabytes = sum(w.numel() for w in dense) * 4 / 2**20
    print(f"{len(shapes)} linears, {megabytes:.0f} MB, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {n: torch.randn(rows, n) for n in {in_f for _, in_f in shapes}}
            blas = median_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense], args.repeats)
            onednn = median_ms(lambda xs=xs: [ONEDNN_LINEAR(xs[w.shape[1]], p, None, "none", [], "")
                                              for w, p in zip(dense, packed)], args.repeats)
            own = median_ms(lambda xs=xs: [native(xs[w.shape[1]], w) for w in dense], args.repeats)
            times = {"blas": blas, "onednn": onednn, "native": own}
            print(f"rows {rows:3d}: " + ", ".join(f"{k} {v:6.1f} ms" for k, v in times.items())
                  + f" -> {min(times, key=times.get)}", flush=True)


if __name__ == "__main__":
    main()
