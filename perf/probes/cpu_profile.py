"""Probe: where does a CPU decode step's time go? Wall ms per step and torch-profiler time by op category.

Runs `--batch` requests (prompts of --prompt-len tokens) to their decode phase, times --steps decode steps, then
profiles the same number of steps and buckets each op's self time into matmul, attention + KV store, elementwise
(norms, RoPE, SiLU-and-mul, residual adds, casts), sampling, other ops, and what no op accounts for (Python
and dispatch: wall minus the ops' summed self time).

    .venv/bin/python -m perf.probes.cpu_profile --batch 1
    .venv/bin/python -m perf.probes.cpu_profile --batch 16 --json perf/results/cpu-speed/profile-b16.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch
from torch.profiler import ProfilerActivity, profile

from inflight import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# First match wins; op names are lower-cased. Compiled (inductor) kernels are named cpp_fused_<ops>.
CATEGORIES = [
    # Inductor's generated C++ loops are not profiled one by one: their time is the graph call's self time.
    ("compiled kernels (fused norm/RoPE/SiLU/residual, decode attention)", ("compiledfxgraph",)),
    ("matmul", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn", "bmm")),
    ("attention + KV store", ("attention", "index_select", "index_fill", "index_copy", "nonzero", "inflight::",
                              "gather", "scatter", "softmax_kv", "_efficient", "_flash")),
    ("sampling", ("argmax", "topk", "sort", "multinomial", "softmax", "log_softmax", "cumsum", "max")),
    ("elementwise (norm, RoPE, SiLU, residual)",
     ("cpp_fused", "add", "mul", "pow", "mean", "rsqrt", "silu", "neg", "cat", "copy", "to", "sub", "div",
      "rms_norm", "where", "embedding", "cos", "sin")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other ops"


def decode_steps(llm: LLM, batch: int, prompt_len: int, warmup: int):
    """Admit `batch` long requests and step until every one is decoding; returns the engine."""
    engine = llm.engine
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", ids[i:i + prompt_len], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    for _ in range(warmup):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    llm = LLM(args.model, max_num_seqs=args.batch, num_kv_blocks=64 * args.batch + 64, block_size=16,
              speculative_method="off")  # plain decode steps of the batch
    engine = decode_steps(llm, args.batch, args.prompt_len, warmup=5)
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall_ms = 1000 * (time.perf_counter() - t) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        prof_wall_ms = 1000 * (time.perf_counter() - t) / args.steps
    by_cat: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.self_cpu_time_total <= 0 or ev.key.startswith("ProfilerStep"):
            continue
        cat = category(ev.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + ev.self_cpu_time_total / 1000 / args.steps
    by_cat["untracked (Python, dispatch)"] = max(0.0, prof_wall_ms - sum(by_cat.values()))
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    result = {"batch": args.batch, "threads": torch.get_num_threads(), "wall_ms_per_step": round(wall_ms, 2),
              "profiled_wall_ms_per_step": round(prof_wall_ms, 2),
              "ms_per_step_by_category": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
              "top_ops_ms_per_step": {e.key: round(e.self_cpu_time_total / 1000 / args.steps, 3) for e in top},
              "load_average_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}
    print(f"batch {args.batch}, {result['threads']} threads: {wall_ms:.1f} ms/step "
          f"({prof_wall_ms:.1f} under the profiler), load {result['load_average_1min']}")
    for cat, ms in result["ms_per_step_by_category"].items():
        print(f"  {cat:42s} {ms:7.2f} ms  {100 * ms / prof_wall_ms:5.1f}%")
    print("top ops (self ms/step): " + ", ".join(f"{k} {v}" for k, v in result["top_ops_ms_per_step"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
