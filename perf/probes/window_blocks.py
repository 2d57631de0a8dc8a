"""Probe: how many KV blocks does a decode step read with sliding windows, and what does that save?

For a model with sliding layers (default: Gemma 3 270M, window 512, one global layer in six), the layer-blocks a
one-row decode step gathers at a few context lengths, counted from the torch reference's own decode plan
(attention/reference.py) with the windows and with every layer full; then, with --time, the engine's median
decode step at the longest context both ways (the "full" run ignores the windows: wrong text, right cost).

    .venv/bin/python -m perf.probes.window_blocks
    .venv/bin/python -m perf.probes.window_blocks --time --json perf/results/models/window-blocks.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch

from inflight.attention import AttentionMetadata, reference
from inflight.model import ModelConfig
from server_harness.host import cpu_model_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def blocks_read(cfg: ModelConfig, context: int, block_size: int, windows: bool) -> int:
    """Layer-blocks one decode row at this context gathers, summed over the layers."""
    blocks = (context + block_size - 1) // block_size
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([context]), cu_seqlens_q=torch.tensor([0, 1]), query_lens=[1],
        seq_lens_host=[context], max_query_len=1, max_seq_len=context)
    total = 0
    for layer in range(cfg.num_layers):
        window = cfg.layer_window(layer) if windows else 0
        tables = reference._decode_plan(meta, [0], [0, 1], block_size, torch.device("cpu"), window)[0]
        total += tables.numel()
    return total


def decode_ms(model: str, context: int, steps: int, windows: bool) -> float:
    """Median wall ms of a one-row decode step after a `context`-token prompt."""
    from inflight import LLM, SamplingParams
    if not windows:
        ModelConfig.layer_window = lambda self, layer: 0  # every layer full: the cost without the window
    llm = LLM(model, max_model_len=context + steps + 8, num_kv_blocks=(context + steps) // 16 + 8,
              max_num_batched_tokens=1024, enable_prefix_caching=False)
    engine = llm.engine
    ids = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * (context // 8))[:context]
    engine.add_request("probe", ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times[len(times) // 2:])  # decode steps only: the prefill chunks come first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "gemma-3-270m"))
    ap.add_argument("--contexts", default="512,1024,2048,4096")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--time", action="store_true", help="also time decode steps at the longest context")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = ModelConfig.from_dir(args.model)
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        windowed = blocks_read(cfg, context, args.block_size, True)
        full = blocks_read(cfg, context, args.block_size, False)
        rows.append({"context": context, "blocks_read": windowed, "blocks_read_without_window": full,
                     "share": round(windowed / full, 3)})
        print(f"context {context}: {windowed} of {full} layer-blocks ({100 * windowed / full:.1f}%)")
    result = {"model": os.path.basename(args.model), "block_size": args.block_size,
              "sliding_window": cfg.sliding_window,
              "layer_windows": [cfg.layer_window(i) for i in range(cfg.num_layers)],
              "rows": rows, "cpu": cpu_model_name(), "threads": torch.get_num_threads()}
    if args.time:
        context = rows[-1]["context"]
        # Each in its own process: the "full" run patches ModelConfig.
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result["decode_ms_window"] = pool.apply(decode_ms, (args.model, context, args.steps, True))
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            result["decode_ms_without_window"] = pool.apply(decode_ms, (args.model, context, args.steps, False))
        print(f"decode step at {context}: {result['decode_ms_window']:.1f} ms with the windows, "
              f"{result['decode_ms_without_window']:.1f} ms without")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)



if __name__ == "__main__":
    main()
