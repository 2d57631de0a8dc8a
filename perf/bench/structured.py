"""What structured output costs: the per-step mask at 64 running requests (null forward), how often a real model's
own choice passes the grammar, the compile and cache, and served throughput with every client constrained against
none (real tritonserver, SmolLM2).

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.bench.structured --json perf/results/structured/result.json
    .venv/bin/python -m perf.bench.structured --steps 5 --skip-served --skip-model       # smoke

1. Host time per step (as perf/bench/host_overhead.py: the engine with a null forward whose logits come from a
   pre-drawn random pool; tiny-llama's config and SmolLM2's 49152-token vocabulary; one torch thread). `--running`
   requests, half of them constrained by a JSON schema (nested object, enum, array), against the same requests all
   unconstrained, for each sampling of STEP_MODES (greedy: the headline; sampled: temperature 1; top_p). Figures
   are medians over the timed steps of the engine thread's CPU time, on the CPU that ran it (`cpu`):
     mask_ms_per_step  everything structured output costs a step before the matchers' accept: the rows masked
                       before sampling (fill + apply) and, for the rows checked after sampling (grammar/bitmask.py),
                       the check, and each refused row's fill and second choice
       mask_apply_ms   of which xgrammar's apply, for the rows masked whole (its C++ loop here, a kernel on CUDA)
     refused_per_step  of the checked rows, those whose first choice the grammar refused. The null forward's
                       logits are noise, so most are: a worst case (section 2 has a real model's share)
     critical_added_ms_per_step  the whole step's host time, constrained minus unconstrained: on a CPU the forward
                       is synchronous and every phase, mask and sample included, is on the critical path
     critical_added_ms_per_step_cuda_convention  the same without the phases a CUDA step overlaps with its forward
                       (advance, overlap, mask, sample): the figure this benchmark reported before (issue 40)
2. Model checks (`--skip-model` to skip): SmolLM2-135M-Instruct asked for the schema, `--model-requests` chat
   prompts greedy and at temperature 1: the share of checked rows whose first choice the grammar accepted, and
   how many outputs are complete JSON within `--model-tokens`.
3. Compile: compile_ms_first (a new schema, the tokenizer's vocabulary read and the compile processes started
   beforehand, as they are once per engine: warm_up_ms), compile_ms_cached (a request for a schema already
   compiled: the handle is ready at once), and cached_ttft_added_ms (what a cached schema adds before the first
   token: cache lookup, a fresh matcher, one mask fill and apply for one row).
4. Served: one tritonserver with `llm` on SmolLM2; `--clients` concurrent gRPC streams replay the A/B mixed load
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
from perf.bench.host_overhead import FILL_STEPS_MAX, OVERLAPPED, PHASES, HostTimer, build_engine, clock
from server_harness.host import cpu_model_name, cpuinfo_field

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-llama"
SMOL = ROOT / "models" / "SmolLM2-135M-Instruct"
# The phases a CUDA step waits for (host_overhead's convention: advance, overlap, mask and sample run while the
# forward does there). On a CPU every phase is on the step's critical path.
CRITICAL_CUDA = tuple(p for p in PHASES if p not in OVERLAPPED)
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

# The sampling of the step benchmark's requests, constrained or not: greedy (the headline), temperature alone (its
# constrained rows are checked after sampling, and a refused one draws again under its mask), and top-p (masked
# whole before sampling: the cut is of the masked distribution).
STEP_MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0},
              "top_p": {"temperature": 0.8, "top_p": 0.95}}


class MaskTimer:
    """Splits the step's mask phase: xgrammar's apply (rows masked whole) timed apart from the rest."""

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
    engine.grammars.warm_up()  # the vocabulary read and the compile processes, once per engine, are no step's cost
    # Compiled before any request comes: else the unconstrained requests decode to their max_tokens while the first
    # compile runs, and the steps timed would hold only the constrained ones.
    from inflight.grammar.spec import from_structured_outputs
    engine.grammars.request(from_structured_outputs({"json": SCHEMA})).result()
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 20000, (int(torch.randint(50, 200, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(running)]
    out: dict = {}
    for mode, sampling in STEP_MODES.items():
        for constrained in (0, running // 2):
            label = f"{mode}_{'constrained' if constrained else 'unconstrained'}"
            out[label] = _time_steps(engine, label, prompts, constrained, sampling, warmup, steps)
    engine.grammars.close()
    report: dict = {"running": running, "constrained_rows": running // 2, "steps": steps, **out}
    for mode in STEP_MODES:
        c, u = out[f"{mode}_constrained"], out[f"{mode}_unconstrained"]
        report[mode] = {"mask_ms_per_step": c["mask_ms"], "critical_added_ms_per_step": c["step_ms"] - u["step_ms"],
                        "critical_added_ms_per_step_cuda_convention": c["critical_cuda_ms"] - u["critical_cuda_ms"],
                        "refused_per_step": c["refused_per_step"], "checked_per_step": c["checked_per_step"]}
    report.update(mask_ms_per_step=report["greedy"]["mask_ms_per_step"],
                  critical_added_ms_per_step=report["greedy"]["critical_added_ms_per_step"])
    return report


def _time_steps(engine, label: str, prompts: list[list[int]], constrained: int, sampling: dict, warmup: int,
                steps: int) -> dict:
    """Admit the requests (the first `constrained` with the schema), prefill them, then time `steps` decode steps
    after `warmup` ones; medians per step."""
    for i, prompt in enumerate(prompts):
        so = {"json": SCHEMA} if i < constrained else None
        engine.add_request(f"{label}{i}", prompt, SamplingParams(
            max_tokens=warmup + steps + FILL_STEPS_MAX, ignore_eos=True, structured_outputs=so, seed=i, **sampling))
    while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
        if engine.waits_only_for_grammars():
            time.sleep(0.01)
        engine.step()
    timer = HostTimer()
    applies = []
    step_mask = engine.step_mask
    with MaskTimer() as mask:
        for i in range(warmup + steps):
            if i == warmup:
                timer = HostTimer()
                engine.set_step_timer(timer)
                checked0, refused0 = step_mask.num_checked, step_mask.num_refused
            before = mask.apply_s
            engine.step()
            if i >= warmup:
                applies.append(mask.apply_s - before)
    engine.set_step_timer(None)
    live = len(engine.seqs)
    for rid in list(engine.groups):
        engine.abort_request(rid)
    laps = timer.steps

    def median_ms(values) -> float:
        return 1000 * statistics.median(values)

    return {
        "running_at_end": live,
        "mask_ms": median_ms(lap.get("mask", 0.0) for lap in laps),
        "mask_apply_ms": median_ms(applies),
        "mask_rest_ms": median_ms(lap.get("mask", 0.0) - a for lap, a in zip(laps, applies)),
        "sample_ms": median_ms(lap.get("sample", 0.0) for lap in laps),
        "detokenize_ms": median_ms(lap.get("detokenize", 0.0) for lap in laps),
        "step_ms": median_ms(sum(lap.values()) for lap in laps),
        "critical_cuda_ms": median_ms(sum(lap.get(p, 0.0) for p in CRITICAL_CUDA) for lap in laps),
        "checked_per_step": (step_mask.num_checked - checked0) / steps,
        "refused_per_step": (step_mask.num_refused - refused0) / steps,
    }


# ---- 2. model checks -------------------------------------------------------------------------------------

def model_checks(num_requests: int, max_tokens: int) -> dict:
    """How often a real model's own choice passes the grammar: SmolLM2 asked for the benchmark's schema, greedy and
    at temperature 1 (rows checked after sampling, refused ones masked and chosen again)."""
    from inflight import EngineConfig
    from inflight.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(SMOL), num_kv_blocks=256, max_model_len=1024, max_num_seqs=16))
    people = ["a retired sailor", "a young chemist", "a city librarian", "a chess coach", "a baker in Lyon",
              "a software tester", "a beekeeper", "a museum guard"]
    out = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        checked0, refused0 = engine.step_mask.num_checked, engine.step_mask.num_refused
        texts: dict[str, str] = {}
        for i in range(num_requests):
            prompt = (f"Describe {people[i % len(people)]} as JSON with the fields name, age, role, tags and "
                      f"address.")
            engine.add_request(f"{mode}{i}", prompt, SamplingParams(
                max_tokens=max_tokens, temperature=temperature, seed=i,
                structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}), apply_chat_template=True)
            texts[f"{mode}{i}"] = ""
        while engine.has_unfinished_requests():
            if engine.waits_only_for_grammars():
                time.sleep(0.01)
            for o in engine.step():
                texts[o.request_id] += o.text_delta
        checked = engine.step_mask.num_checked - checked0
        refused = engine.step_mask.num_refused - refused0
        out[mode] = {"checked_rows": checked, "refused_rows": refused, "accepted_fraction": 1 - refused / checked,
                     "complete_json": sum(_is_json(t) for t in texts.values()), "requests": num_requests}
    engine.grammars.close()
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# ---- 3. compile and cache ---------------------------------------------------------------------------------

def compile_costs() -> dict:
    from transformers import AutoTokenizer

    from inflight.grammar.bitmask import StepMask
    from inflight.grammar.compiler import GrammarCache
    from inflight.grammar.spec import from_structured_outputs

    tok = AutoTokenizer.from_pretrained(SMOL)
    cache = GrammarCache(lambda: AutoTokenizer.from_pretrained(SMOL), 49152, [tok.eos_token_id])
    t0 = time.perf_counter()
    cache.warm_up()
    warm_up_ms = 1000 * (time.perf_counter() - t0)
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
        mask.apply(logits, [row], check_first=False)  # the whole mask: the first token's worst case
        t2 = time.perf_counter()
        assert ready and handle.cache_hit
        cached.append(1000 * (t1 - t0))
        added.append(1000 * (t2 - t0))
    cache.close()
    return {"warm_up_ms": warm_up_ms, "compile_ms_first": first_ms,
            "compile_ms_cached": statistics.median(cached), "cached_ttft_added_ms": statistics.median(added)}


# ---- 4. served throughput ---------------------------------------------------------------------------------

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
    ap.add_argument("--skip-model", action="store_true", help="skip the checked rows' acceptance on SmolLM2")
    ap.add_argument("--model-requests", type=int, default=8)
    ap.add_argument("--model-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as host_overhead: the host's share, not OpenMP's barriers on a shared machine
    t_start = time.perf_counter()
    report: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_model_name(),
                    "cpu_family_model": f"{cpuinfo_field('cpu family')}/{cpuinfo_field('model')}"}
    steps = step_costs(args.running, args.steps, args.warmup, args.seed)
    report["steps"] = steps
    report.update(mask_ms_per_step=steps["mask_ms_per_step"],
                  critical_added_ms_per_step=steps["critical_added_ms_per_step"])
    for mode in STEP_MODES:
        m = steps[mode]
        print(f"{mode}: mask {m['mask_ms_per_step']:.3f} ms/step at {args.running} running "
              f"({steps['constrained_rows']} constrained, {m['refused_per_step']:.1f} of {m['checked_per_step']:.1f} "
              f"checked rows refused), step +{m['critical_added_ms_per_step']:.3f} ms "
              f"(+{m['critical_added_ms_per_step_cuda_convention']:.3f} without mask and sample)", file=sys.stderr)
    if not args.skip_model:
        torch.set_num_threads(os.cpu_count() or 1)
        report["model_checks"] = model_checks(args.model_requests, args.model_tokens)
        torch.set_num_threads(1)
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
