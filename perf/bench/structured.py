"""What structured output costs: the per-step mask at 64 running requests (null forward), the compile and cache,
and served throughput with every client constrained against none (real tritonserver, SmolLM2).

    .venv/bin/python -m perf.bench.structured --json perf/results/structured/result.json    # about 5 minutes
    .venv/bin/python -m perf.bench.structured --steps 5 --requests 16 --skip-served           # smoke

1. Host time per step (as perf/bench/host_overhead.py: the engine with a null forward whose logits come from a
   pre-drawn random pool; tiny-llama's config and SmolLM2's 49152-token vocabulary). `--running` requests, half of
   them constrained by a JSON schema (nested object, enum, array), against the same requests all unconstrained.
   Figures are medians over the timed steps of the engine thread's CPU time:
     mask_fill_ms      filling the bitmask rows from the matchers (host work)
     mask_apply_ms     applying it to the logits (on this CPU a C++ loop over the rows; on CUDA one kernel)
     mask_ms_per_step  the two together: all the mask costs a step on this CPU
     critical_added_ms_per_step  the critical path (host_overhead's convention: the phases the device waits
                       for) constrained minus unconstrained; the matchers' accept of each sampled token is here
2. Compile: compile_ms_first (a new schema, the tokenizer's vocabulary read beforehand, as it is once per engine),
   compile_ms_cached (a request for a schema already compiled: the handle is ready at once), and
   cached_ttft_added_ms (what a cached schema adds before the first token: cache lookup, a fresh matcher, one
   mask fill and apply for one row).
3. Served: one tritonserver with `llm` on SmolLM2; `--clients` concurrent gRPC streams replay the A/B mixed load
   (perf.ab.workloads "mixed", output lengths exact: ignore_eos, and a schema that cannot close before them), all
   unconstrained then all constrained, twice in alternation; tokens/s = output tokens / wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from inflight.sequence import SamplingParams
from perf.bench.host_overhead import FILL_STEPS_MAX, PHASES, HostTimer, build_engine, clock
from server_harness.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct"
CRITICAL = tuple(p for p in PHASES if p not in ("advance", "overlap", "mask", "sample"))
# The benchmark's schema: a nested object, an enum, an array, required fields.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "role", "tags", "address"]}
# Served: a schema whose shortest answer is longer than any output of the load, so every request runs to its
# max_tokens as the unconstrained ones do (the A/B load's lengths are exact).
LONG_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 400}}, "required": ["items"]}


# ---- 1. host time per step ------------------------------------------------------------------------------

class MaskTimer:
    """Splits the step's mask phase into fill and apply (xgrammar's apply wrapped and timed apart)."""

    def __init__(self):
        import xgrammar as xgr
        self.xgr, self.real = xgr, xgr.apply_token_bitmask_inplace
        self.apply_s = 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = clock()
            self.real(*args, **kwargs)
            self.apply_s += clock() - t0
        self.xgr.apply_token_bitmask_inplace = timed
        return self

    def __exit__(self, *exc):
        self.xgr.apply_token_bitmask_inplace = self.real


def step_costs(running: int, steps: int, warmup: int, seed: int) -> dict:
    engine = build_engine(str(TINY), running, 200, warmup + steps + FILL_STEPS_MAX, seed)
    pool_logits = engine.runner.model.compute_logits
    engine.runner.model.compute_logits = lambda h: pool_logits(h).clone()  # the mask writes in place
    engine.grammars.compiler()  # the vocabulary read, once per engine, is not a step's cost
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 20000, (int(torch.randint(50, 200, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(running)]
    out = {}
    for label, constrained in (("unconstrained", 0), ("constrained", running // 2)):
        for i, prompt in enumerate(prompts):
            so = {"json": SCHEMA} if i < constrained else None
            engine.add_request(f"{label}{i}", prompt, SamplingParams(
                max_tokens=warmup + steps + FILL_STEPS_MAX, temperature=0.0, ignore_eos=True, structured_outputs=so))
        while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
            if engine.waits_only_for_grammars():
                time.sleep(0.01)
            engine.step()
        timer = HostTimer()
        fills, applies = [], []
        with MaskTimer() as mask:
            for i in range(warmup + steps):
                if i == warmup:
                    timer = HostTimer()
                    engine.set_step_timer(timer)
                before = mask.apply_s
                engine.step()
                if i >= warmup:
                    applies.append(mask.apply_s - before)
        engine.set_step_timer(None)
        live = len(engine.seqs)
        for rid in list(engine.groups):
            engine.abort_request(rid)
        laps = timer.steps
        for lap, applied in zip(laps, applies):
            fills.append(lap.get("mask", 0.0) - applied)
        out[label] = {
            "running_at_end": live,
            "mask_fill_ms": 1000 * statistics.median(fills),
            "mask_apply_ms": 1000 * statistics.median(applies),
            "mask_ms": 1000 * statistics.median(lap.get("mask", 0.0) for lap in laps),
            "detokenize_ms": 1000 * statistics.median(lap.get("detokenize", 0.0) for lap in laps),
            "critical_ms": 1000 * statistics.median(sum(lap.get(p, 0.0) for p in CRITICAL) for lap in laps),
        }
    engine.grammars.close()
    c, u = out["constrained"], out["unconstrained"]
    return {"running": running, "constrained_rows": running // 2, "steps": steps, **out,
            "mask_ms_per_step": c["mask_ms"], "critical_added_ms_per_step": c["critical_ms"] - u["critical_ms"]}


# ---- 2. compile and cache ---------------------------------------------------------------------------------

def compile_costs() -> dict:
    from transformers import AutoTokenizer

    from inflight.grammar.bitmask import StepMask
    from inflight.grammar.compiler import GrammarCache
    from inflight.grammar.spec import from_structured_outputs

    tok = AutoTokenizer.from_pretrained(SMOL)
    cache = GrammarCache(lambda: AutoTokenizer.from_pretrained(SMOL), 49152, [tok.eos_token_id])
    t0 = time.perf_counter()
    cache.compiler()
    vocab_ms = 1000 * (time.perf_counter() - t0)
    spec = from_structured_outputs({"json": SCHEMA})
    t0 = time.perf_counter()
    first = cache.request(spec)
    first.result()
    first_ms = 1000 * (time.perf_counter() - t0)
    cached, added = [], []
    mask = StepMask(49152, [tok.eos_token_id])
    logits = torch.randn(1, 49152)

    class Row:  # what StepMask reads of a sequence
        params = SamplingParams()
        num_output_tokens = 0

    for _ in range(20):
        t0 = time.perf_counter()
        handle = cache.request(spec)
        ready = handle.is_ready
        t1 = time.perf_counter()
        row = Row()
        row.grammar_matcher = cache.new_matcher(handle)
        mask.apply(logits, [row])
        t2 = time.perf_counter()
        assert ready and handle.cache_hit
        cached.append(1000 * (t1 - t0))
        added.append(1000 * (t2 - t0))
    cache.close()
    return {"tokenizer_vocabulary_ms": vocab_ms, "compile_ms_first": first_ms,
            "compile_ms_cached": statistics.median(cached), "cached_ttft_added_ms": statistics.median(added)}


# ---- 3. served throughput ---------------------------------------------------------------------------------

def served(clients: int, num_requests: int, scale: float, rounds: int) -> dict:
    from transformers import AutoTokenizer

    from perf.ab import workloads
    from server_harness.repository import make_model_repository
    from server_harness.server import TritonServer
    from server_harness.stream_client import StreamClient

    load = workloads.build("mixed", AutoTokenizer.from_pretrained(SMOL), scale, num_requests)
    tmp = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    repo = make_model_repository(ROOT / "model_repository", tmp / "repo", {"llm": {"model": SMOL}})

    def run(constrained: bool, tag: str) -> float:
        todo: queue.Queue = queue.Queue()
        for i, r in enumerate(load.requests):
            todo.put((i, r))
        tokens = [0]
        lock = threading.Lock()

        def client(c: int) -> None:
            stream = StreamClient(server.grpc_url)
            try:
                while True:
                    try:
                        i, r = todo.get_nowait()
                    except queue.Empty:
                        return
                    values = {"stream": True, "ignore_eos": True, "temperature": 0.0,
                              "return_num_output_tokens": True,
                              "sampling_parameters": json.dumps({"max_tokens": r.max_tokens, **(
                                  {"structured_outputs": {"json": LONG_SCHEMA}} if constrained else {})})}
                    stream.send("llm", f"{tag}-{i}", r.prompt, values)
                    assert stream.wait_finals(600, [f"{tag}-{i}"]), "no final"
                    rec = stream.records[f"{tag}-{i}"]
                    assert rec.error is None, rec.error
                    with lock:
                        tokens[0] += rec.num_output_tokens
            finally:
                stream.close()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = tokens[0] / (time.perf_counter() - t0)
        print(f"served {'constrained' if constrained else 'unconstrained'}: {tokens[0]} tokens, {rate:.1f} tok/s",
              file=sys.stderr)
        return rate

    rates: dict[bool, list[float]] = {False: [], True: []}
    with TritonServer(repo, log_path=tmp / "server.log") as server:
        run(True, "warm")  # the schema compiles once here, as a chat app's first request would
        for k in range(rounds):
            for constrained in ((False, True) if k % 2 == 0 else (True, False)):
                rates[constrained].append(run(constrained, f"r{k}{int(constrained)}"))
    return {"clients": clients, "requests": num_requests, "scale": scale, "rounds": rounds,
            "unconstrained_tok_s": statistics.fmean(rates[False]), "constrained_tok_s": statistics.fmean(rates[True]),
            "unconstrained_runs": rates[False], "constrained_runs": rates[True],
            "constrained_over_unconstrained": statistics.fmean(rates[True]) / statistics.fmean(rates[False])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48, help="requests per served run")
    ap.add_argument("--scale", type=float, default=0.25, help="the mixed load's lengths x this (as perf.ab)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-served", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as host_overhead: the host's share, not OpenMP's barriers on a shared machine
    t_start = time.perf_counter()
    report: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model_name()}
    steps = step_costs(args.running, args.steps, args.warmup, args.seed)
    report["steps"] = steps
    report.update(mask_ms_per_step=steps["mask_ms_per_step"],
                  critical_added_ms_per_step=steps["critical_added_ms_per_step"])
    print(f"mask {steps['mask_ms_per_step']:.3f} ms/step at {args.running} running "
          f"({steps['constrained_rows']} constrained), critical path +{steps['critical_added_ms_per_step']:.3f} ms",
          file=sys.stderr)
    report.update(compile_costs())
    if not args.skip_served:
        torch.set_num_threads(os.cpu_count() or 1)
        report["served"] = served(args.clients, args.requests, args.scale, args.rounds)
        report.update(constrained_tok_s=report["served"]["constrained_tok_s"],
                      unconstrained_tok_s=report["served"]["unconstrained_tok_s"])
    report["seconds"] = time.perf_counter() - t_start
    report["load_average"] = os.getloadavg()
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0



if __name__ == "__main__":
    sys.exit(main())
