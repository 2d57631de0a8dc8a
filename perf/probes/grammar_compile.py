"""Grammar compiles under a costly client: how long a trivial regex waits with a costly schema compiling, what the
costliest specs the caps accept take to compile on this CPU, and what the compile processes hold in memory.

    .venv/bin/python -m perf.probes.grammar_compile [--model models/SmolLM2-135M-Instruct] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from inflight.grammar.compiler import GrammarCache
from inflight.grammar.cost import MAX_UNITS
from inflight.grammar.spec import from_structured_outputs
from inflight.model.config import ModelConfig
from inflight.tokenizer import load_tokenizer

from server_harness.host import cpu_model_name


def strings(*bounds: int) -> dict:
    """A JSON object of strings, one per maxLength bound."""
    return {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": b} for i, b in enumerate(bounds)}}


# The costliest accepted specs: at the cap, in the forms the cost model counts.
AT_THE_CAP = {
    "two plateaued strings (256 units)": {"json": strings(256, 257)},
    "four strings of 61..64 (250 units)": {"json": strings(*range(61, 65))},
    "sixteen strings of 8..23 (248 units)": {"json": strings(*range(8, 24))},
    "regex, two plateaued classes (256 units)": {"regex": "[^x]{0,128}y.{0,129}"},
}


def private_mb(pid: int) -> float:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024


def new_cache(model: str, timeout_ms: int) -> GrammarCache:
    tokenizer = load_tokenizer(model)
    vocab = ModelConfig.from_path(model).vocab_size
    return GrammarCache(lambda: load_tokenizer(model), vocab, [tokenizer.eos_token_id], timeout_ms=timeout_ms)


def trivial_waits(cache: GrammarCache, rounds: int) -> list[float]:
    """Seconds to a ready `yes|no` regex (a new spec each round) sent 0.2 s after a costly schema."""
    waits = []
    for i in range(rounds):
        costly = cache.request(from_structured_outputs({"json": strings(200 + 2 * i, 201 + 2 * i)}))
        time.sleep(0.2)
        t0 = time.monotonic()
        cache.request(from_structured_outputs({"regex": f"yes|no|r{i}"})).future.result(timeout=120)
        waits.append(time.monotonic() - t0)
        costly.future.result(timeout=120)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cache = new_cache(args.model, timeout_ms=600_000)  # no deadline here: the whole compile time is the figure
    cache.warm_up()
    memory = {lane: round(private_mb(pid), 1) for lane, pid in cache.pool.pids().items()}
    waits = trivial_waits(cache, args.rounds)
    at_cap = {}
    for name, spec in AT_THE_CAP.items():
        t0 = time.monotonic()
        compiled = cache.request(from_structured_outputs(spec)).future.result(timeout=600)
        at_cap[name] = {"seconds": round(time.monotonic() - t0, 2), "ok": compiled.error is None}
    memory_after = {lane: round(private_mb(pid), 1) for lane, pid in cache.pool.pids().items()}
    cache.close()
    out = {"cpu": cpu_model_name(), "pid": os.getpid(), "max_units": MAX_UNITS,
           "trivial_regex_ready_s": [round(w, 3) for w in waits], "trivial_regex_ready_max_s": round(max(waits), 3),
           "trivial_regex_ready_median_s": round(statistics.median(waits), 3),
           "compile_at_the_cap": at_cap, "worker_private_mb_started": memory, "worker_private_mb_after": memory_after}
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
