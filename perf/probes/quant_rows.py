"""Probe: is the native quantized product faster than float32 at every row count? (why it serves all steps)

Milliseconds for all of SmolLM2's linears and its lm_head at a few row counts: int8 (per channel), GGUF's Q8_0
(int8 per 32) and int4 (Q4_1 blocks) through quant_rows.c's tiled product, against the float32 weights through
oneDNN (prepacked) and decode_step.c's float product. Random weights of the model's shapes, every layer its own
(so they stream from memory as in a real step); median of --repeats passes.

    .venv/bin/python -m perf.probes.quant_rows
    .venv/bin/python -m perf.probes.quant_rows --rows 1,4,16,64,256 --json perf/results/quantization/quant-rows.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch

from inflight.model import ModelConfig
from inflight.model.linear import PACK_ROWS_HINT
from inflight.model.native_decode import few_row_product, quant_product
from inflight.model.quant import quantize_int4, quantize_int8
from inflight.onednn import ONEDNN_LINEAR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q), (2 * cfg.intermediate_size, cfg.hidden_size),
             (cfg.hidden_size, cfg.intermediate_size)]
    return layer * cfg.num_layers + [(cfg.vocab_size, cfg.hidden_size)]


def timed(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(1000 * (time.perf_counter() - t))
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes(ModelConfig.from_path(args.model))]
    int8 = [quantize_int8(w) for w in weights]
    q8_0 = [quantize_int8(w, 32) for w in weights]
    int4 = [quantize_int4(w) for w in weights]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in weights] if ONEDNN_LINEAR else []
    qprod, fprod = quant_product(), few_row_product()
    results = []
    for n in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(n, w.shape[1], generator=gen) for w in weights]
        def run(fn, items, xs=xs):
            return timed(lambda: [fn(x, w) for x, w in zip(xs, items)], args.repeats)
        row = {"rows": n,
               "int8_native_ms": run(lambda x, q: qprod(x, q, None), int8),
               "int4_native_ms": run(lambda x, q: qprod(x, q, None), int4),
               "q8_0_native_ms": run(lambda x, q: qprod(x, q, None), q8_0),
               "float32_native_ms": run(lambda x, w: fprod(x, w), weights)}
        if packed:
            row["float32_onednn_ms"] = run(lambda x, p: ONEDNN_LINEAR(x, p, None, "none", [], ""), packed)
        results.append(row)
        print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
