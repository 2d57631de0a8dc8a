"""At how many running requests does speculative decoding stop paying on this CPU?

The offline engine (no server) runs closed loops of b requests (each one that finishes is replaced at once) with
drafts on every step (speculative_disable_by_batch_size out of the way, speculative_draft_policy always) and with
speculation off, on two workloads: the copy-heavy tasks of perf.bench.spec (generated files the outputs copy from:
the best case for drafts; named "grounded" here, as when the default was chosen) and the
A/B "mixed" workload (random words, ignore_eos: the load of the c16 target). It prints tokens/s for each and their
ratio per b; the default speculative_disable_by_batch_size is the largest b at which drafting still paid on both
(docs/speculative.md).

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.probes.spec_break_even --json perf/results/spec/break-even.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
from transformers import AutoTokenizer

from inflight import LLM, SamplingParams
from perf.ab import workloads as ab_workloads
from perf.bench import spec_tasks
from server_harness.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


def closed_loop(llm: LLM, requests: list[tuple[str, SamplingParams]], concurrency: int) -> dict:
    """Every request through the engine with `concurrency` of them in flight; output tokens per second."""
    engine = llm.engine
    todo = list(requests)
    live = 0
    tokens = 0
    t0 = time.perf_counter()
    while todo or live:
        while todo and live < concurrency:
            prompt, params = todo.pop(0)
            engine.add_request(f"r{len(todo)}-{time.perf_counter_ns()}", prompt, params)
            live += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            live -= out.finished
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def workload(name: str, tokenizer, size: int, per_slot: int) -> list[tuple[str, SamplingParams]]:
    count = max(size * per_slot, 4)
    if name == "grounded":
        tasks = spec_tasks.copy_heavy_tasks(tokenizer)
        return [(tasks[i % len(tasks)].prompt, SamplingParams(max_tokens=tasks[i % len(tasks)].max_tokens,
                                                                temperature=0.0)) for i in range(count)]
    mixed = ab_workloads.build("mixed", tokenizer, 0.25, count, seed=size)
    # "sampled": the same load at temperature 1 (seeded), where drafts are accepted far less often.
    temperature = 1.0 if name == "sampled" else 0.0
    return [(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=temperature, seed=i, ignore_eos=True))
            for i, r in enumerate(mixed.requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16")
    ap.add_argument("--workloads", default="grounded,mixed")
    ap.add_argument("--per-slot", type=int, default=2, help="requests per concurrency slot")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help="default: EngineConfig's")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    common = dict(max_num_seqs=max(sizes), num_kv_blocks=2048, max_num_batched_tokens=512)
    spec = dict(speculative_method="ngram", speculative_disable_by_batch_size=1 << 20,
                speculative_draft_policy="always")
    if args.num_speculative_tokens:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    engines = {"off": LLM(str(MODEL), speculative_method="off", **common), "on": LLM(str(MODEL), **spec, **common)}
    rows = []
    for name in args.workloads.split(","):
        for size in sizes:
            requests = workload(name, tokenizer, size, args.per_slot)
            row = {"workload": name, "running": size}
            for side in engines:  # alternating per size: a shared machine's slow minutes fall on both
                row[side] = closed_loop(engines[side], requests, size)
            row["ratio"] = round(row["on"]["tokens_per_s"] / row["off"]["tokens_per_s"], 3)
            rows.append(row)
            print(f"{name:9s} b={size:3d} " + " ".join(f"{side} {row[side]['tokens_per_s']:7.1f}" for side in engines)
                  + f"  tokens/s  ratio {row['ratio']:.3f}", flush=True)
    pays = {}
    for name in args.workloads.split(","):
        ok = [r["running"] for r in rows if r["workload"] == name and r["ratio"] >= 1.0]
        pays[name] = max(ok) if ok else 0
    result = {"cpu": cpu_model_name(), "load_average": os.getloadavg(), "rows": rows, "largest_running_that_pays": pays,
              "num_speculative_tokens": engines["on"].engine.config.num_speculative_tokens}
    print(json.dumps({"largest_running_that_pays": pays}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))



if __name__ == "__main__":
    main()
