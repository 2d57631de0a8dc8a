"""Where an engine step's time goes on this machine, and what that makes of the in-flight/static ceiling.

Measures decode step time t(b) against the number of running requests b on the engine alone (no server),
splits it into scheduler / model forward / sampler / detokenizer, fits t(b) = a + c*b, and computes for
each A/B workload the throughput ratio in-flight batching can reach over static batches when a step's cost
grows with its batch: in-flight keeps b = B rows every step; a static batch of the mix runs until its longest
request ends with ever fewer rows. With c = 0 this is the plain ceiling max-length / mean-length.

    .venv/bin/python -m perf.bench.step_cost --out perf/results/<name>/step_cost.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from perf.ab import workloads as ab_workloads

ROOT = Path(__file__).resolve().parents[2]


class _Timed:
    """Wraps a callable and adds its wall time to a total."""

    def __init__(self, fn):
        self.fn, self.total = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t


def measure(model: Path, sizes: list[int], num_steps: int) -> list[dict]:
    from inflight import EngineConfig, SamplingParams
    from inflight.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), max_num_seqs=max(sizes), max_num_batched_tokens=4096,
                                    speculative_method="off"))  # plain decode steps of b rows
    parts = {"scheduler": ("scheduler", "schedule"), "forward": ("runner", "execute"),
             "detokenizer": ("detokenizer", "update")}
    rows = []
    for b in sizes:
        for i in range(b):
            engine.add_request(f"b{b}-{i}", "The quick brown fox jumps over the lazy dog " * 3,
                               SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True))
        while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # prefill (and its first token) is not what we time
        timers = {}
        for name, (owner, method) in parts.items():
            obj = getattr(engine, owner)
            timers[name] = _Timed(getattr(obj, method))
            setattr(obj, method, timers[name])
        timers["sampler"] = engine.sampler = _Timed(engine.sampler)
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        step_s = (time.perf_counter() - t0) / num_steps
        for owner, method in parts.values():
            delattr(getattr(engine, owner), method)
        engine.sampler = timers["sampler"].fn
        while engine.has_unfinished_requests():
            engine.step()
        rows.append({"b": b, "step_ms": 1e3 * step_s,
                     **{f"{k}_ms": 1e3 * t.total / num_steps for k, t in timers.items()}})
        print(f"[step-cost] b={b}: {rows[-1]['step_ms']:.1f} ms/step "
              f"(forward {rows[-1]['forward_ms']:.1f}, scheduler {rows[-1]['scheduler_ms']:.2f}, "
              f"sampler {rows[-1]['sampler_ms']:.1f}, detokenizer {rows[-1]['detokenizer_ms']:.2f})", flush=True)
    return rows


def static_ratio(lengths: list[int], batch: int, a: float, c: float) -> float:
    """In-flight tokens/s at a full batch over a static batch's tokens/s, with step cost a + c * rows."""
    mix = [lengths[i % len(lengths)] for i in range(batch)]
    inflight = batch / (a + c * batch)
    steps = range(1, max(mix) + 1)
    static_time = sum(a + c * sum(1 for n in mix if n >= s) for s in steps)
    return inflight / (sum(mix) / static_time)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    ap.add_argument("--scale", type=float, default=0.15, help="workload length scale, as in perf.ab")
    ap.add_argument("--batch", type=int, default=16, help="batch size (concurrency) for the ceilings")
    ap.add_argument("--out", type=Path, help="also write the Markdown here")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    rows = measure(args.model, [int(s) for s in args.sizes.split(",")], args.steps)
    bs = np.array([r["b"] for r in rows], dtype=float)
    c, a = np.polyfit(bs, np.array([r["step_ms"] for r in rows]), 1)
    lines = [f"# Engine step cost on this machine ({args.model.name})", "",
             f"{os.cpu_count()} CPUs, load average {load:.2f} at start, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; {args.steps} decode steps per size, "
             "prompts of ~30 tokens.",
             "", "| running requests | step (ms) | model forward | sampler | scheduler | detokenizer | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['b']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} | {r['sampler_ms']:.1f} | "
                     f"{r['scheduler_ms']:.2f} | {r['detokenizer_ms']:.2f} | {1e3 * r['b'] / r['step_ms']:.1f} |")
    lines += ["", f"Fit: t(b) = {a:.1f} ms + {c:.2f} ms x b. The fixed part is what in-flight batching amortizes over "
              "a full batch; the per-row part is spent whatever the strategy, so it caps the gain.", "",
              f"| workload (scale {args.scale}) | output lengths | ceiling max/mean | ceiling with t(b) at batch "
              f"{args.batch} |", "|---|---|---:|---:|"]
    for name, (_, outputs, _, _) in ab_workloads.SPECS.items():
        lengths = [max(1, round(n * args.scale)) for n in outputs]
        plain = max(lengths) / (sum(lengths) / len(lengths))
        lines.append(f"| {name} | {lengths} | {plain:.2f} | {static_ratio(lengths, args.batch, a, c):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
