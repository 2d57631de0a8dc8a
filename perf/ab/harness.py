"""A/B/C the batchers: one tritonserver with every arm, identical workloads from one streaming gRPC load
generator (perf.ab.loadgen; perf_analyzer on request, for the arms it can drive), a concurrency sweep and a
genai-perf cross-check, then a report under perf/results/<name>/.

    .venv/bin/python -m perf.ab --quick                      # SmolLM2, all arms, ~20 min on 2 cores
    .venv/bin/python -m perf.ab --workloads mixed --concurrency 1,4,16,64 --name mixed-sweep
    .venv/bin/python -m perf.ab --workloads mixed --concurrency 16 --ablation   # + ours with each feature off
    .venv/bin/python -m perf.ab                              # the full sweep (hours on a CPU)
    .venv/bin/python -m perf.ab --tiny --results-dir /tmp/ab # tiny-llama, seconds (the test suite)

Arms: inflight = `llm` (ours); iterative = `llm_iterative` (Triton's iterative sequence batcher); dynamic =
`llm_ensemble` (preprocessing -> llm_dynamic -> postprocessing, Triton's dynamic batcher).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from perf.ab import tools as ab_tools
from perf.ab import workloads as ab_workloads
from perf.ab.loadgen import Arrival, run_load
from perf.ab.metrics import load_profile, summarize
from perf.ab.report import Cell, WorkloadInfo, plot, read_csv, write_csv, write_markdown

from server_harness.repository import (DYNAMIC_MODEL, INFLIGHT_MODEL, ITERATIVE_MODEL, build_repository, copy_model,
                                       load_config)
from server_harness.server import TritonServer

ROOT = Path(__file__).resolve().parents[2]

ARM_MODELS = {"inflight": INFLIGHT_MODEL, "iterative": ITERATIVE_MODEL, "dynamic": DYNAMIC_MODEL}
ENGINE_MODELS = {"inflight": "llm", "iterative": "llm_iterative", "dynamic": "llm_dynamic"}  # whose /metrics to read
# --ablation: ours with one feature off, and Triton's iterative batcher around a plain engine step (each handed
# request's whole next iteration, no prefix cache): arm -> (model copied, its name, the engine parameters). Without
# chunked prefill a step must hold a whole prompt, so the token budget rises to the model length (2048).
_NO_CHUNKING = {"enable_chunked_prefill": "false", "max_num_batched_tokens": "2048"}
ABLATIONS = {
    "inflight-no-chunked": (INFLIGHT_MODEL, "llm_no_chunked", _NO_CHUNKING),
    "inflight-no-prefix": (INFLIGHT_MODEL, "llm_no_prefix", {"enable_prefix_caching": "false"}),
    "inflight-no-fastlane": (INFLIGHT_MODEL, "llm_no_fastlane",
                             {"fast_lane_max_prompt_tokens": "0", "fast_lane_max_tokens": "0"}),
    "iterative-plain": (ITERATIVE_MODEL, "llm_iterative_plain", {**_NO_CHUNKING, "enable_prefix_caching": "false"}),
}
for _arm, (_, _model, _) in ABLATIONS.items():
    ARM_MODELS[_arm] = ENGINE_MODELS[_arm] = _model
ALL_CONCURRENCY = (1, 4, 16, 64)
TOOLS = ("loadgen", "perf_analyzer")


@dataclass
class Plan:
    model: Path
    engine_params: dict[str, str]
    scale: float
    sweep: list[tuple[str, tuple[int, ...]]]  # workload -> concurrencies
    min_requests: int
    requests_per_client: int
    cell_timeout_s: float
    genai: list[tuple[int, int]] = field(default_factory=list)  # (concurrency, requests) per arm
    torch_threads: int | None = None  # OMP_NUM_THREADS for the model processes; None: torch's default
    arms: tuple[str, ...] = ("inflight", "iterative", "dynamic")
    tool: str = "loadgen"
    arrival: Arrival = field(default_factory=lambda: Arrival("closed"))

    def num_requests(self, concurrency: int, fixed: int | None) -> int:
        return fixed or max(self.min_requests, self.requests_per_client * concurrency)


def preset(mode: str) -> Plan:
    smol = ROOT / "models" / "SmolLM2-135M-Instruct"
    if mode == "tiny":  # seconds: the test suite runs this end to end
        tiny = ROOT / "models" / "tiny-llama"
        return Plan(tiny, {"model": str(tiny), "kv_cache_memory_bytes": str(16 << 20)}, 0.1,
                    [("mixed", (1, 4)), ("shared_prefix", (4,))],
                    min_requests=4, requests_per_client=2, cell_timeout_s=60, genai=[(4, 8)], torch_threads=1)
    if mode == "quick":  # about 15 minutes on the 2-core CPU, three arms: the mixed sweep, the other workloads at 8
        return Plan(smol, {"model": str(smol)}, 0.15,
                    [("mixed", (1, 4, 16)), ("short_short", (8,)), ("short_long", (8,)), ("long_short", (8,)),
                     ("shared_prefix", (8,))],
                    min_requests=4, requests_per_client=2, cell_timeout_s=300, genai=[(8, 16)], torch_threads=1)
    return Plan(smol, {"model": str(smol)}, 0.25, [(w, ALL_CONCURRENCY) for w in ab_workloads.SPECS],
                min_requests=16, requests_per_client=4, cell_timeout_s=3600, genai=[(16, 64)],
                torch_threads=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="SmolLM2, mixed sweep + one concurrency for the rest")
    mode.add_argument("--tiny", action="store_true", help="tiny-llama, a few requests per cell (for tests)")
    ap.add_argument("--name", help="results folder name (default: the mode and a timestamp)")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "perf" / "results")
    ap.add_argument("--workloads", help=f"comma-separated subset of {','.join(ab_workloads.SPECS)}")
    ap.add_argument("--concurrency", help="comma-separated concurrencies for every chosen workload")
    ap.add_argument("--requests", type=int, help="requests per cell (default: per-client share of the mode)")
    ap.add_argument("--scale", type=float, help="token length scale (1 = the seeds' lengths)")
    ap.add_argument("--model", type=Path, help="Hugging Face folder served by both arms")
    ap.add_argument("--source", type=Path, default=ROOT / "model_repository",
                    help="model repository the arms are copied from (e.g. a clean `git worktree` checkout's)")
    ap.add_argument("--queue-delay-us", type=int, help="override llm_dynamic's max_queue_delay_microseconds")
    ap.add_argument("--torch-threads", type=int, help="OMP_NUM_THREADS for the server's model processes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="split each cell into this many runs per arm, alternating arms (for a shared machine)")
    ap.add_argument("--arms", help=f"comma-separated subset of {','.join(ARM_MODELS)} (default: the three batchers)")
    ap.add_argument("--ablation", action="store_true",
                    help="add ours with chunked prefill, the prefix cache and the fast lane each turned off, and "
                         "the iterative arm with neither chunked prefill nor prefix cache (iterative-plain)")
    ap.add_argument("--tool", choices=TOOLS, default="loadgen",
                    help="loadgen (one streaming gRPC client, every arm) or perf_analyzer (not the iterative arm)")
    ap.add_argument("--arrival", default="closed",
                    help="closed (next request when a client is free) or poisson:R (R requests/s, at most "
                         "--concurrency in flight)")
    ap.add_argument("--no-genai-perf", action="store_true", help="skip the genai-perf cross-check")
    ap.add_argument("--replot", type=Path, metavar="RESULTS_DIR", help="only redraw the plots of an earlier run")
    ap.add_argument("--keep-raw", action="store_true", help="keep perf_analyzer exports and logs in the results")
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace) -> tuple[str, Plan]:
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    plan = preset(mode)
    if args.model:
        plan.model = args.model.resolve()
        plan.engine_params["model"] = str(plan.model)
    if args.scale:
        plan.scale = args.scale
    if args.workloads or args.concurrency:
        names = args.workloads.split(",") if args.workloads else [w for w, _ in plan.sweep]
        unknown = [w for w in names if w not in ab_workloads.SPECS]
        if unknown:
            raise SystemExit(f"--workloads {unknown[0]!r} is unknown: allowed {', '.join(ab_workloads.SPECS)}")
        default = dict(plan.sweep)
        conc = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None
        plan.sweep = [(w, conc or default.get(w, ALL_CONCURRENCY)) for w in names]
    if args.torch_threads:
        plan.torch_threads = args.torch_threads
    if args.no_genai_perf:
        plan.genai = []
    if args.arms:
        plan.arms = tuple(args.arms.split(","))
        unknown = [a for a in plan.arms if a not in ARM_MODELS]
        if unknown:
            raise SystemExit(f"--arms {unknown[0]!r} is unknown: allowed {', '.join(ARM_MODELS)}")
    if args.ablation:
        plan.arms = tuple(dict.fromkeys((*plan.arms, *ABLATIONS)))
    plan.tool = args.tool
    if plan.tool == "perf_analyzer" and any(a.startswith("iterative") for a in plan.arms):
        raise SystemExit("--tool perf_analyzer cannot drive the iterative arm (it sends its own sequence ids to a "
                         "sequence-batched model): allowed --arms without iterative, or --tool loadgen")
    try:
        plan.arrival = Arrival.parse(args.arrival)
    except ValueError as e:
        raise SystemExit(f"--{e}") from None
    return mode, plan


def run_pair(server: TritonServer, workload: ab_workloads.Workload, concurrency: int, num_requests: int,
             rounds: int, first: int, work: Path, timeout_s: float, arms: tuple[str, ...] = tuple(ARM_MODELS)[:3],
             tool: str = "loadgen", arrival: Arrival = Arrival("closed")) -> dict[str, Cell]:
    """Every arm on the same requests, in `rounds` runs each that rotate the arms' order (ABC, BCA, ...), so
    background load that comes and goes hits all alike. Round r sends the r-th slice of the requests to each."""
    cells = {arm: Cell(workload.name, concurrency, arm, ARM_MODELS[arm]) for arm in arms}
    exports: dict[str, list] = {arm: [] for arm in arms}
    bounds = [round(i * num_requests / rounds) for i in range(rounds + 1)]
    for r in range(rounds):
        part = ab_workloads.Workload(workload.name, workload.description, workload.requests[bounds[r]:bounds[r + 1]],
                                     workload.prompt_tokens, workload.prefix_tokens)
        shift = (first + r) % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            cell = cells[arm]
            if cell.error:
                continue
            stem = work / f"{workload.name}-c{concurrency}-{arm}-r{r}"
            for attempt in (1, 2):
                try:
                    exports[arm].append(_measure(server, cell, part, stem, timeout_s, tool, arrival))
                    break
                except ab_tools.EmptyExport as e:
                    if attempt == 2:
                        cell.error = str(e)
                except (ab_tools.ToolError, ValueError, OSError) as e:
                    cell.error = str(e)
                    break
    for arm, cell in cells.items():
        if not cell.error:
            try:
                cell.stats = summarize(exports[arm])
            except ValueError as e:
                cell.error = str(e)
    return cells


def _measure(server: TritonServer, cell: Cell, part: ab_workloads.Workload, stem: Path, timeout_s: float,
             tool: str, arrival: Arrival) -> list:
    """One run of one arm; adds the run's engine figures (steps, queue times, Triton's queue statistic, and for the
    dynamic arm its batch sizes) to the cell only once the run's timings were read, so a rerun does not count a
    failed run's work."""
    engine = ENGINE_MODELS[cell.arm]
    dynamic = cell.arm == "dynamic"
    batches_before = ab_tools.dynamic_batch_counts(server.metrics_url) if dynamic else {}
    before = ab_tools.inflight_step_totals(server.metrics_url, engine)
    queue_before = ab_tools.triton_queue_totals(server.http_base, engine)
    if tool == "loadgen":
        result = run_load(server.grpc_url, cell.model, part.requests, cell.concurrency, arrival,
                          request_timeout_s=timeout_s)
        timings = result.timings
        if result.errors and not any(t.response_ns for t in timings):
            raise ab_tools.ToolError(f"loadgen: every request failed, e.g. {result.errors[0]}")
    else:
        input_data = part.write_input_data(stem.with_suffix(".input.json"))
        ab_tools.perf_analyzer(cell.model, server.grpc_url, input_data, cell.concurrency, len(part.requests),
                               stem.with_suffix(".export.json"), timeout_s)
        timings = load_profile(stem.with_suffix(".export.json"))
    time.sleep(1.2)  # the engine's metrics reach /metrics once a second
    after = ab_tools.inflight_step_totals(server.metrics_url, engine)
    for key, value in after.items():
        cell.steps[key] = cell.steps.get(key, 0.0) + value - before.get(key, 0.0)
    queue_after = ab_tools.triton_queue_totals(server.http_base, engine)
    cell.triton_queue = (cell.triton_queue[0] + queue_after[0] - queue_before[0],
                         cell.triton_queue[1] + queue_after[1] - queue_before[1])
    if dynamic:
        batches_after = ab_tools.dynamic_batch_counts(server.metrics_url)
        for size, count in ab_tools.batch_delta(batches_before, batches_after).items():
            cell.batches[size] = cell.batches.get(size, 0) + count
    return timings


def _batcher_line(repo: Path) -> str:
    config = load_config(repo / "llm_dynamic" / "config.pbtxt")
    batcher = config.dynamic_batching
    return (f"max_batch_size {config.max_batch_size}, preferred {list(batcher.preferred_batch_size)}, "
            f"max_queue_delay {batcher.max_queue_delay_microseconds / 1000:g} ms")


def _load_line(plan: Plan) -> str:
    if plan.tool == "perf_analyzer":
        return ("perf_analyzer (`-i grpc --streaming --input-data`, one async thread, bounded by --request-count), "
                "closed loop at the concurrency")
    arrival = ("closed loop (the next request as soon as a client is free)" if plan.arrival.kind == "closed"
               else f"Poisson arrivals at {plan.arrival.rate:g} requests/s, at most the concurrency in flight")
    return (f"perf.ab.loadgen: one gRPC stream per client (tritonclient, streaming), the same requests in the same "
            f"order for every arm, {arrival}")


def describe(cell: Cell, seconds: float) -> str:
    if cell.stats is None:
        return f"FAILED ({seconds:.0f} s): {cell.error.splitlines()[0] if cell.error else '?'}"
    s = cell.stats
    extra = f", mean batch {cell.mean_batch:.1f}" if cell.arm == "dynamic" else f", {cell.step_summary}"
    return (f"{s.tokens_per_s:.1f} tok/s, {s.requests_per_s:.2f} req/s, TTFT p50/p99 {s.ttft_p50_ms:.0f}/"
            f"{s.ttft_p99_ms:.0f} ms, ITL p50 {s.itl_p50_ms:.1f} ms, queue mean {cell.queue_mean_ms:.0f} ms{extra} "
            f"(cell {seconds:.0f} s)")


def build_workloads(plan: Plan, tokenizer, fixed_requests: int | None) -> dict[str, ab_workloads.Workload]:
    """Each workload once, as many requests as its largest cell needs (smaller cells take a prefix)."""
    workloads = {}
    for w, concs in plan.sweep:
        largest = max(plan.num_requests(c, fixed_requests) for c in concs)
        workloads[w] = ab_workloads.build(w, tokenizer, plan.scale, largest)
    return workloads


def run_sweep(server: TritonServer, plan: Plan, workloads: dict, tokenizer, args, work: Path) -> list[Cell]:
    """A warm-up pair, then every (workload, concurrency) cell of the plan on both arms."""
    warm = ab_workloads.build("short_short", tokenizer, plan.scale, 4)
    warm.requests = [ab_workloads.Request(r.prompt, 4) for r in warm.requests]
    # first calls pay for lazy initialisation
    run_pair(server, warm, 2, 4, 1, 0, work, plan.cell_timeout_s, plan.arms, plan.tool, plan.arrival)
    cells: list[Cell] = []
    total = sum(len(c) for _, c in plan.sweep)
    done = 0
    for w, concs in plan.sweep:
        for concurrency in concs:
            n = plan.num_requests(concurrency, args.requests)
            rounds = max(1, min(args.rounds, n // max(1, concurrency)))  # a round keeps every client busy
            t0 = time.monotonic()
            pair = run_pair(server, workloads[w], concurrency, n, rounds, done, work, plan.cell_timeout_s, plan.arms,
                            plan.tool, plan.arrival)
            cells += pair.values()
            done += 1
            for arm, cell in pair.items():
                print(f"[ab] {done}/{total} {w} c={concurrency} n={n} x{rounds} {arm}: "
                      f"{describe(cell, time.monotonic() - t0)}", flush=True)
    return cells


def run_genai_checks(server: TritonServer, plan: Plan, tokenizer, work: Path) -> list[dict]:
    """genai-perf on the arms it can drive (its perf_analyzer cannot drive llm_iterative): an independent count of
    tokens (it re-tokenizes the text) and latencies."""
    genai = []
    for concurrency, n in plan.genai:
        lengths = ab_workloads.build("mixed", tokenizer, plan.scale, 4).output_lengths
        mean = round(sum(lengths) / len(lengths))
        std = round((sum((x - mean) ** 2 for x in lengths) / len(lengths)) ** 0.5)
        for arm in (a for a in plan.arms if a in ("inflight", "dynamic")):
            model = ARM_MODELS[arm]
            t0 = time.monotonic()
            entry = {"arm": arm, "model": model, "concurrency": concurrency, "requests": n,
                     "input_tokens": 32, "output_mean": mean, "output_stddev": std}
            for attempt in (1, 2):  # its perf_analyzer now and then leaves an empty export behind
                try:
                    s = entry["stats"] = ab_tools.genai_perf(model, server.grpc_url, plan.model, concurrency, n, 32,
                                                             mean, std, work / f"genai-{arm}-{attempt}",
                                                             plan.cell_timeout_s)
                    print(f"[ab] genai-perf {arm} c={concurrency}: {s.tokens_per_s:.1f} tok/s, TTFT p99 "
                          f"{s.ttft_p99_ms:.0f} ms ({time.monotonic() - t0:.0f} s)", flush=True)
                    entry.pop("error", None)
                    break
                except (ab_tools.ToolError, KeyError, ValueError, OSError) as e:
                    entry["error"] = str(e)
                    print(f"[ab] genai-perf {arm} attempt {attempt} FAILED: {str(e).splitlines()[0]}", flush=True)
            genai.append(entry)
    return genai


def write_results(out_dir: Path, cells: list[Cell], genai: list[dict], workloads: dict, meta: dict) -> None:
    infos = {w: WorkloadInfo(w, wl.description, wl.prompt_tokens, wl.prefix_tokens, wl.output_lengths, wl.ceiling)
             for w, wl in workloads.items()}
    write_csv(cells, infos, out_dir / "results.csv")
    plots = plot(cells, list(infos), out_dir)
    write_markdown(cells, infos, genai, meta, plots, out_dir / "report.md")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        cells = read_csv(args.replot / "results.csv")
        print("[ab] redrew", plot(cells, list(dict.fromkeys(c.workload for c in cells)), args.replot))
        return 0
    mode, plan = make_plan(args)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = args.name or f"{mode}-{stamp}"
    out_dir = args.results_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ab-"))
    t_start = time.monotonic()
    load_before = os.getloadavg()
    print(f"[ab] {mode}: model {plan.model.name}, scale {plan.scale}, sweep {plan.sweep}; results {out_dir}",
          flush=True)

    from transformers import AutoTokenizer  # after argument errors: this import takes seconds
    tokenizer = AutoTokenizer.from_pretrained(plan.model)
    workloads = build_workloads(plan, tokenizer, args.requests)
    repo = build_repository(args.source.resolve(), work / "model_repository", plan.engine_params,
                            max_queue_delay_us=args.queue_delay_us, iterative="iterative" in plan.arms)
    for arm in (a for a in plan.arms if a in ABLATIONS):
        source_model, model, params = ABLATIONS[arm]
        copy_model(args.source.resolve(), source_model, repo, as_name=model, params={**plan.engine_params, **params})
    env = {"OMP_NUM_THREADS": str(plan.torch_threads)} if plan.torch_threads else {}
    server = TritonServer(repo, log_path=work / "server.log", startup_timeout_s=900, env=env)
    print(f"[ab] starting tritonserver (log {server.log_path})", flush=True)
    with server:
        print(f"[ab] server ready in {time.monotonic() - t_start:.0f} s at {server.grpc_url}", flush=True)
        cells = run_sweep(server, plan, workloads, tokenizer, args, work)
        genai = run_genai_checks(server, plan, tokenizer, work)
    leftovers = server.leftovers()

    meta = {
        "name": name, "date (UTC)": stamp,
        "mode": mode + (" preset, custom sweep" if args.workloads or args.concurrency else ""),
        "model": plan.model.name, "length scale": plan.scale,
        "machine": f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} before / {os.getloadavg()[0]:.2f} after",
        "OMP_NUM_THREADS": plan.torch_threads or "unset (torch default)",
        "load": _load_line(plan),
        "llm_dynamic batcher": _batcher_line(repo),
        "wall time": f"{time.monotonic() - t_start:.0f} s",
        "arms from": str(args.source.resolve()),
        "command": "python -m perf.ab " + " ".join(argv if argv is not None else sys.argv[1:]),
        "server leftovers": "; ".join(leftovers) or "none",
    }
    write_results(out_dir, cells, genai, workloads, meta)
    if args.keep_raw:
        shutil.copytree(work, out_dir / "raw", dirs_exist_ok=True, ignore=shutil.ignore_patterns("model_repository"))
    # A failed cross-check is in the report; only failed perf_analyzer cells fail the run.
    failed = [c for c in cells if c.stats is None]
    if failed or leftovers or any("stats" not in g for g in genai):
        print(f"[ab] kept logs and exports for the failures in {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[ab] report {out_dir / 'report.md'} ({len(cells) - len(failed)} cells ok, {len(failed)} failed, "
          f"{time.monotonic() - t_start:.0f} s)", flush=True)
    # Leftovers are reported (report.md, above) but do not fail a measurement: on a machine shared with other
    # servers the helper can mistake a region of theirs, created while we ran, for ours.
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
