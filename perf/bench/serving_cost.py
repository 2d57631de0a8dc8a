"""What serving costs: the same load through the offline engine (`LLM` in-process: the same engine options as the
served `llm` config, the same torch threads) and through the served arms (tritonserver + gRPC + our load generator),
with served tokens/s over offline tokens/s and where the difference goes, per output token.

    .venv/bin/python -m perf.bench.serving_cost --out perf/results/serving-cost/README.md --json F
    .venv/bin/python -m perf.bench.serving_cost --tiny            # tiny-llama, seconds (a smoke test)

The load: one workload of perf.ab (default: mixed at scale 0.25), closed loop at --concurrency, the same requests in
the same order. Offline, a driver keeps `concurrency` requests in the engine and adds the next one the moment one
finishes (no network, no client); served, perf.ab.loadgen does the same over gRPC. Throughput is taken over the same
steady window (perf.ab.metrics).

Where the time goes, per output token, from the processes' own CPU clocks (/proc) and the engine's /metrics:
  engine step: the engine's step time (its histogram), offline and served: the served one is larger when the other
      processes take CPU time the step would have had (2 cores here);
  engine thread: CPU of the stub's busiest thread (the one stepping the engine; iterative: the execute thread);
  stub, other threads: the rest of the stub's CPU (ours: the sender thread's IPC to the server, the cancellation
      poller, the metrics exporter; iterative: the same minus the sender);
  tritonserver: the server process (gRPC, the python backend's IPC, the batchers, response serialization);
  client: this process while the load ran (tritonclient's streams and callbacks).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from server_harness.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[2]
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    """One way of serving the load."""
    name: str
    tokens_per_s: float
    output_tokens: int
    window_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    step_ms_per_token: float  # engine step seconds / tokens, over the whole run
    run_ms_per_token: float = 0.0  # the whole run's wall time (first request sent -> last final) / tokens
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)  # process part -> CPU ms per token
    steps: int = 0
    errors: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m perf.bench.serving_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny-llama, few requests (a smoke test)")
    ap.add_argument("--model", type=Path, help="Hugging Face folder (default SmolLM2-135M-Instruct)")
    ap.add_argument("--workload", default="mixed", help="a perf.ab workload (default mixed)")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--arms", default="inflight,iterative",
                    help="served arms: inflight (llm), iterative (llm_iterative)")
    ap.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS, offline and in the served models")
    ap.add_argument("--json", type=Path, help="write the runs as JSON")
    ap.add_argument("--out", type=Path, help="write a Markdown report")
    args = ap.parse_args(argv)
    if args.tiny:
        args.model = args.model or ROOT / "models" / "tiny-llama"
        args.requests, args.concurrency, args.scale = min(args.requests, 12), min(args.concurrency, 4), 0.1
    args.model = (args.model or ROOT / "models" / "SmolLM2-135M-Instruct").resolve()
    return args


def engine_options(model: Path, tiny: bool) -> dict[str, str]:
    """The served `llm` config's engine parameters (strings, as Triton passes them), for the same model."""
    from inflight.config import EngineConfig
    from serving.options import flatten_triton_parameters
    from server_harness.repository import load_config
    from google.protobuf import json_format
    config = json_format.MessageToDict(load_config(ROOT / "model_repository" / "llm" / "config.pbtxt"),
                                       preserving_proto_field_name=True)
    names = {f for f in EngineConfig.__dataclass_fields__}
    options = {k: v for k, v in flatten_triton_parameters(config).items() if k in names and v != ""}
    options["model"] = str(model)
    if tiny:
        options["kv_cache_memory_bytes"] = str(16 << 20)
    return options


# ---- offline -----------------------------------------------------------------------------------------------

def run_offline(options: dict[str, str], requests, concurrency: int) -> Run:
    """`LLM` in this process; a closed loop of `concurrency` requests, the next added as one finishes."""
    from inflight import LLM, SamplingParams
    from perf.ab.metrics import RequestTiming, summarize

    llm = LLM(**options)
    engine = llm.engine
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([r.prompt for r in requests[:2]], [warm, warm], use_tqdm=False)  # first calls pay for lazy init
    timings: dict[str, RequestTiming] = {}
    queue = list(range(len(requests)))

    def add_next() -> None:
        i = queue.pop(0)
        rid = f"r{i}"
        timings[rid] = RequestTiming(time.monotonic_ns(), [], [])
        engine.add_request(rid, requests[i].prompt, params[i])

    steps_before = _engine_steps(engine.metrics.snapshot())
    cpu_before = _self_cpu_s()
    t0 = time.monotonic()
    for _ in range(min(concurrency, len(queue))):
        add_next()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic_ns()
        for out in outs:
            t = timings[out.request_id]
            if out.new_token_ids:
                t.response_ns.append(now)
                t.tokens.append(len(out.new_token_ids))
            if out.finished and queue:
                add_next()
    cpu = _self_cpu_s() - cpu_before
    seconds = time.monotonic() - t0
    steps, step_s = (a - b for a, b in zip(_engine_steps(engine.metrics.snapshot()), steps_before))
    stats = summarize([list(timings.values())])
    run = _run("offline (LLM in-process)", stats, steps, step_s, seconds)
    run.cpu_ms_per_token = {"process": 1e3 * cpu / stats.output_tokens}
    return run


def _engine_steps(snapshot: dict) -> tuple[float, float]:
    h = snapshot["histograms"]["step_time_seconds"]
    return h["count"], h["sum"]


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _run(name: str, stats, steps: float, step_s: float, seconds: float) -> Run:
    tokens = max(stats.output_tokens, 1)
    return Run(name, stats.tokens_per_s, stats.output_tokens, stats.window_s, stats.ttft_p50_ms, stats.ttft_p99_ms,
               stats.itl_p50_ms, 1e3 * step_s / tokens, 1e3 * seconds / tokens, steps=int(steps),
               errors=stats.num_errors)


# ---- served ------------------------------------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def _thread_cpu_s(pid: int) -> dict[int, float]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def _stub_pid(server_pid: int, model: str) -> int:
    from server_harness.process import STUB_ARG_PARENT, python_stubs
    for pid, argv in python_stubs():  # argv[1]: <repository>/<model>/<version>/model.py ("llm_" prefixes others)
        if len(argv) > STUB_ARG_PARENT and argv[STUB_ARG_PARENT] == str(server_pid) and \
                Path(argv[1]).parts[-3:-2] == (model,):
            return pid
    raise RuntimeError(f"no python-backend stub of model {model} under server {server_pid}")


def run_served(server, arm: str, model: str, requests, concurrency: int) -> Run:
    from perf.ab import tools as ab_tools
    from perf.ab.loadgen import run_load
    from perf.ab.metrics import summarize

    stub = _stub_pid(server.pid, model)
    before = (_proc_cpu_s(server.pid), _thread_cpu_s(stub), _self_cpu_s(),
              ab_tools.inflight_step_totals(server.metrics_url, model))
    result = run_load(server.grpc_url, model, requests, concurrency)
    cpu_server, threads, cpu_client = _proc_cpu_s(server.pid), _thread_cpu_s(stub), _self_cpu_s()
    time.sleep(1.2)  # the engine's metrics reach /metrics once a second
    totals = ab_tools.inflight_step_totals(server.metrics_url, model)
    stats = summarize([result.timings])
    delta = {tid: cpu - before[1].get(tid, 0.0) for tid, cpu in threads.items()}
    busiest = max(delta.values())
    per_token = 1e3 / stats.output_tokens
    run = _run(f"served: {arm} ({model})", stats, totals["steps"] - before[3]["steps"],
               totals["step_s"] - before[3]["step_s"], result.seconds)
    run.cpu_ms_per_token = {
        "engine thread": busiest * per_token,
        "stub, other threads": (sum(delta.values()) - busiest) * per_token,
        "tritonserver": (cpu_server - before[0]) * per_token,
        "client": (cpu_client - before[2]) * per_token,
    }
    return run


def serve(args, options: dict[str, str], arms: list[str], requests, work: Path) -> list[Run]:
    from perf.ab.loadgen import run_load
    from server_harness.repository import copy_model, load_config
    from server_harness.server import TritonServer

    models = {"inflight": "llm", "iterative": "llm_iterative"}
    repo = work / "model_repository"
    for arm in arms:  # the same engine options (those the scheduler ignores in llm_iterative are not in its config)
        known = load_config(ROOT / "model_repository" / models[arm] / "config.pbtxt").parameters
        params = {k: v for k, v in options.items() if k in known}
        copy_model(ROOT / "model_repository", models[arm], repo, params=params)
    env = {"OMP_NUM_THREADS": str(args.torch_threads)}
    runs = []
    with TritonServer(repo, log_path=work / "server.log", startup_timeout_s=600, env=env) as server:
        for arm in arms:
            run_load(server.grpc_url, models[arm], requests[:2], 2)  # first calls pay for lazy init
        for arm in arms:
            runs.append(run_served(server, arm, models[arm], requests, args.concurrency))
            print(f"[serving_cost] {runs[-1].name}: {runs[-1].tokens_per_s:.1f} tok/s", flush=True)
    return runs


# ---- report ------------------------------------------------------------------------------------------------

def markdown(runs: list[Run], meta: dict) -> str:
    offline = runs[0]
    lines = ["# What serving costs: offline engine vs served arms", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| run | tokens/s | served / offline | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
              "engine step ms/token | steps | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r.name} | {r.tokens_per_s:.1f} | {100 * r.tokens_per_s / offline.tokens_per_s:.1f}% | "
                     f"{r.ttft_p50_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.itl_p50_ms:.1f} | {r.step_ms_per_token:.2f} | "
                     f"{r.steps} | {r.errors} |")
    lines += ["", "## Where the difference goes, per output token", "",
              "Over the whole run (first request sent to last final, all tokens; the table above takes throughput over "
              "the steady window only): wall ms per token, the engine's step time per token (the gap between them: "
              "time the engine did not step, e.g. waiting for a request to arrive, or, for `iterative`, Triton's "
              "work between two executes), and CPU ms per token from each process's own clocks (/proc). On 2 cores "
              "the engine thread competes with everything else in the list.", "",
              "| run | wall ms/token | + vs offline | engine step ms/token | + vs offline | not stepping | "
              "engine thread CPU | stub, other threads | tritonserver | client |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        wall = r.run_ms_per_token
        base_wall, base_step = offline.run_ms_per_token, offline.step_ms_per_token
        cpu = r.cpu_ms_per_token
        cells = [cpu.get(k) for k in ("engine thread", "stub, other threads", "tritonserver", "client")]
        if r is offline:
            cells = [cpu.get("process"), None, None, None]
        lines.append(f"| {r.name} | {wall:.2f} | {wall - base_wall:+.2f} | {r.step_ms_per_token:.2f} | "
                     f"{r.step_ms_per_token - base_step:+.2f} | {wall - r.step_ms_per_token:.2f} | "
                     + " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # before torch loads (inflight imports it)
    import inflight  # noqa: F401 - it sets OpenMP's wait policy as the served engine has it
    import tempfile

    import torch
    from transformers import AutoTokenizer

    from perf.ab import workloads as ab_workloads

    torch.set_num_threads(args.torch_threads)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ("inflight", "iterative")]
    if unknown:
        raise SystemExit(f"--arms {unknown[0]!r} is unknown: allowed inflight, iterative")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = ab_workloads.build(args.workload, tokenizer, args.scale, args.requests).requests
    options = engine_options(args.model, args.tiny)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    runs = [run_offline(options, requests, args.concurrency)]
    print(f"[serving_cost] {runs[0].name}: {runs[0].tokens_per_s:.1f} tok/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="serving-cost-"))
    runs += serve(args, options, arms, requests, work)
    meta = {"model": args.model.name, "workload": f"{args.workload} x {args.scale}, {args.requests} requests, "
            f"closed loop at concurrency {args.concurrency}", "engine options": "model_repository/llm/config.pbtxt's",
            "torch threads": args.torch_threads, "CPU": f"{cpu_model_name()}, {os.cpu_count()} CPUs",
            "load average": f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after",
            "wall time": f"{time.monotonic() - t0:.0f} s",
            "command": "python -m perf.bench.serving_cost " + " ".join(argv if argv is not None else sys.argv[1:])}
    text = markdown(runs, meta)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "runs": [asdict(r) for r in runs]}, indent=1))
    return 0



if __name__ == "__main__":
    sys.exit(main())
