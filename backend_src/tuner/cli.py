"""`python -m tuner`: tune the engine to an SLA. Calibrate step costs, make traces, search configs in virtual
time, verify on the real server. This module parses the subcommands and runs each one.

    python -m tuner calibrate --out DIR                    # times engine steps -> DIR/cost.json (minutes)
    python -m tuner trace --mix seed --rate 1.5 --requests 1000 --out FILE
    python -m tuner search --cost DIR/cost.json --trace FILE --ttft-p99-ms 1000 --itl-p99-ms 250 --name NAME --out DIR
    python -m tuner verify --out DIR --trace FILE --duration 120   # real tritonserver, chosen vs default config
    python -m tuner prefixes LOG --out DIR                 # prefix-cache hit rates per block size and pool
    python -m tuner simulate --cost DIR/cost.json --trace FILE --set max_num_seqs=16   # one config's figures
    python -m tuner refresh-configs                        # after llm/config.pbtxt changed: tuned configs follow

Every command writes summary.json beside its report (keys chosen, sla, predicted, measured, default_measured;
null where the command has no such figure). Run the timing commands under `flock /tmp/cpu-heavy.lock`.
Paths default to the checkout (models/, model_repository/) when the package runs from one, else to the
current directory (an installed image: /opt/llm). See docs/tune.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from server_harness.host import cpuinfo_field



def _project_root() -> Path:
    """The checkout this package lives in (backend_src/tuner, installed editable), else the current directory
    (a wheel in site-packages: the image's layout, /opt/llm, has models/ and model_repository/ there)."""
    checkout = Path(__file__).resolve().parents[2]
    return checkout if (checkout / "model_repository").is_dir() else Path.cwd()


ROOT = _project_root()
PROG = "python -m tuner"
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
DEFAULT_REPO = ROOT / "model_repository"
TUNED = ("threads", "max_num_seqs", "max_num_batched_tokens", "fast_lane_share", "block_size",
         "kv_cache_memory_bytes")
SUMMARY_KEYS = ("chosen", "sla", "predicted", "measured", "default_measured")


def say(msg: str) -> None:
    print(msg, flush=True)


def write_summary(out: Path, data: dict) -> None:
    data = {**dict.fromkeys(SUMMARY_KEYS), **data}
    command = " ".join([PROG, *sys.argv[1:]])
    data.setdefault("commands", {})[sys.argv[1] if len(sys.argv) > 1 else "?"] = command
    (out / "summary.json").write_text(json.dumps(data, indent=1, default=float) + "\n")


def wait_quiet(max_load: float | None, max_wait_s: float) -> None:
    """Wait until the 1-minute load average is below max_load (other work on a shared machine inflates every
    timing), at most max_wait_s; then go on whatever it is (the reports record the load)."""
    if not max_load:
        return
    deadline = time.monotonic() + max_wait_s
    next_note = 0.0
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        if time.monotonic() >= next_note:
            say(f"[tune] load average {os.getloadavg()[0]:.2f} > {max_load}: waiting (at most "
                f"{deadline - time.monotonic():.0f} s more)")
            next_note = time.monotonic() + 60
        time.sleep(5)
    say(f"[tune] load average {os.getloadavg()[0]:.2f}: starting")


@contextlib.contextmanager
def timed_section(args):
    """Around each timed part: wait for a quiet machine (--quiet-load), then hold --lock (flock) while timing,
    and let go between parts so other people's heavy jobs can run in between."""
    wait_quiet(args.quiet_load, args.quiet_wait_s)
    if not args.lock:
        yield
        return
    with open(args.lock, "a") as f:
        say(f"[tune] waiting for {args.lock}")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            wait_quiet(args.quiet_load, min(args.quiet_wait_s, 120))  # whoever held the lock has just stopped
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def tokenizer_of(model: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model))


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, float32 (the CPU dtype)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim * 4


def _cpu_gemm() -> str:
    """The CPU GEMM an engine built here takes (config default, operator override and this CPU resolved)."""
    from inflight.config import EngineConfig
    from inflight.cpu_defaults import resolve_cpu_defaults
    from inflight.env_overrides import apply_env_overrides
    return resolve_cpu_defaults(apply_env_overrides(EngineConfig())).cpu_gemm


def code_version() -> str:
    """The last commit that changed the engine's sources (backend_src, less this tuner), '+dirty' with uncommitted
    changes there: what a step's cost depends on (the tuner, perf/ and docs do not change it)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()
    sources = ("backend_src", ":(exclude)backend_src/tuner")
    head = git("log", "-1", "--format=%h", "--abbrev=12", "--", *sources) or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", *sources) else "")


# ---- calibrate ---------------------------------------------------------------------------------------------
def cmd_calibrate(args) -> int:
    from tuner.cost import FEATURES, FORM, fit
    from tuner.report import calibrate_report

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model.resolve()
    kv_bytes = kv_bytes_per_token(model)
    fits = {}
    for threads in args.threads:
        with tempfile.TemporaryDirectory() as tmp, timed_section(args):
            points_path = Path(tmp) / "points.json"
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            load_before = os.getloadavg()
            say(f"[calibrate] {model.name}, {threads} thread(s), load average {load_before[0]:.2f}")
            done = subprocess.run([sys.executable, "-m", "tuner", "calibrate-worker", "--model", str(model),
                                   "--threads", str(threads), "--reps", str(args.reps), "--json", str(points_path),
                                   "--clock", args.clock, "--retries", str(args.retries)]
                                  + (["--quick"] if args.quick else []), env=env)
            if done.returncode:
                return done.returncode
            points = json.loads(points_path.read_text())
            (args.out / f"points-{threads}.json").write_text(json.dumps(points))  # kept if a later part fails
        f = fit(points)
        cpu_share = sum(min(p["cpu_ms"]) for p in points) / sum(min(p["wall_ms"]) for p in points)
        fits[str(threads)] = {"coef_ms": f.coef_ms, "knee": f.knee, "stats": f.stats, "points": points,
                              "clock": args.clock,
                              "cpu_per_wall": round(cpu_share, 3),
                              "load_average": [round(x, 2) for x in load_before + os.getloadavg()]}
        say(f"[calibrate] {threads} thread(s): {describe_fit(f)}")
    default_threads = int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}).stdout.strip() or 1)
    previous = args.out / "cost.json"
    if args.keep_other_threads and previous.exists():
        # Re-measure some thread counts (e.g. one that ran while the machine was busy), keep the others' fits,
        # as long as they were taken on this host, for this model, with this code.
        old = json.loads(previous.read_text())
        if (old["host"]["hostname"], old["model"]["name"], old["code_version"]) == (
                platform.node(), model.name, code_version()):
            fits = {**{t: f for t, f in old["fits"].items() if t not in fits}, **fits}
        else:
            say(f"[calibrate] {previous} is from another host, model or code version: not kept")
    cost = {
        "form": FORM, "features": list(FEATURES),
        "host": {"hostname": platform.node(), "cpu": cpuinfo_field("model name") or platform.processor() or "unknown",
                 "cpus": os.cpu_count(),
                 "torch": _torch_version(), "cpu_gemm": _cpu_gemm(),
                 "default_threads": default_threads},
        "model": {"name": model.name, "path": str(model), "kv_bytes_per_token": kv_bytes,
                  "config_sha256": hashlib.sha256((model / "config.json").read_bytes()).hexdigest()[:16]},
        "dtype": "float32", "code_version": code_version(),
        "created": datetime.datetime.now().isoformat(timespec="seconds"), "grid": "quick" if args.quick else "full",
        "fits": fits,
    }
    from tuner.cost import CostModel
    CostModel(cost).save(args.out / "cost.json")
    calibrate_report(cost, args.out)
    write_summary(args.out, {"cost": {t: f["stats"] for t, f in fits.items()}, "host": cost["host"],
                             "model": cost["model"], "code_version": cost["code_version"]})
    say(f"[calibrate] wrote {args.out / 'cost.json'} and {args.out / 'cost.md'}")
    return 0



def _torch_version() -> str:
    import torch
    return torch.__version__


def describe_fit(f) -> str:
    return (f"mean abs error {f.stats['mean_abs_rel_err']:.1%} (5-fold CV {f.stats['cv_mean_abs_rel_err']:.1%}, "
            f"max {f.stats['max_abs_rel_err']:.0%}), knee {f.knee:g}K, coefficients (ms) "
            + ", ".join(f"{k} {v:.3g}" for k, v in f.coef_ms.items()))


def cmd_refit(args) -> int:
    """Fit cost.json's stored points again (after the model's form changed): no new measurements."""
    from tuner.cost import FORM, CostModel, fit
    from tuner.report import calibrate_report

    cost = CostModel.load(args.cost)
    for t, entry in cost.data["fits"].items():
        f = fit(entry["points"])
        entry.update(coef_ms=f.coef_ms, knee=f.knee, stats=f.stats)
        say(f"[refit] {t} thread(s): {describe_fit(f)}")
    cost.data["form"] = FORM
    cost.save(args.cost)
    calibrate_report(cost.data, args.cost.parent)
    summary = args.cost.parent / "summary.json"
    if summary.exists():  # calibrate's summary: the fit statistics follow the new fit
        data = json.loads(summary.read_text())
        data["cost"] = {t: entry["stats"] for t, entry in cost.data["fits"].items()}
        summary.write_text(json.dumps(data, indent=1, default=float) + "\n")
    return 0


def cmd_calibrate_worker(args) -> int:
    import inflight  # noqa: F401 - before torch: the OpenMP wait policy the server runs with (inflight sets it)
    import torch

    from tuner.calibrate import FULL_GRID, QUICK_GRID, calibrate
    torch.set_num_threads(args.threads)
    points = calibrate(str(args.model), QUICK_GRID if args.quick else FULL_GRID, args.reps, args.clock, args.retries,
                       say)
    Path(args.json).write_text(json.dumps(points))
    return 0


# ---- trace ---------------------------------------------------------------------------------------------------
def cmd_trace(args) -> int:
    from tuner import trace as traces

    if args.from_log:
        reqs = traces.from_log(args.from_log, args.rate, args.output_tokens, args.burstiness, args.seed,
                                   args.requests)
    else:
        reqs = traces.make_mix(args.mix, args.rate, args.requests, tokenizer_of(args.model), args.scale,
                                   args.burstiness, args.seed)
    traces.write(args.out, reqs)
    outs = [r.output_tokens for r in reqs]
    say(f"[trace] {len(reqs)} requests over {reqs[-1].arrival_s:.1f} s ({traces.offered_rate(reqs):.2f} req/s), "
        f"{sum(outs)} output tokens (mean {sum(outs) / len(outs):.1f}) -> {args.out}")
    return 0


# ---- simulate / search ---------------------------------------------------------------------------------------
def default_options(repo: Path, cost) -> dict:
    """The engine options of repo/llm/config.pbtxt (what the default config serves), with the host's default
    torch threads (the server runs with OMP_NUM_THREADS unset)."""
    from tuner.config_writer import engine_parameters
    from tuner.sim import engine_config

    params = engine_parameters((repo / "llm" / "config.pbtxt").read_text())
    names = set(engine_config({}).__dataclass_fields__) - {"model", "dtype", "device"}
    options = {k: v for k, v in params.items() if k in names and v.strip()}
    options = {k: v for k, v in vars(engine_config(options)).items() if k in names}
    threads = int(cost.data["host"].get("default_threads", 1))
    if threads not in cost.threads:  # not calibrated: the nearest thread count that was
        threads = min(cost.threads, key=lambda t: (abs(t - threads), t))
    options["threads"] = threads
    return options


def load_trace(path: Path, cost, model: Path | None):
    from tuner import trace as traces
    from tuner.sim import prepare

    trace = traces.load(path)
    tok = tokenizer_of(model or Path(cost.data["model"]["path"]))
    return trace, prepare(trace, tok), tok


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        out[key.strip()] = [_number(v) for v in value.split(",")] if "," in value else _number(value)
    return out


def _number(text: str):
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def cmd_simulate(args) -> int:
    from tuner.cost import CostModel
    from tuner.sim import simulate

    cost = CostModel.load(args.cost)
    _, reqs, _ = load_trace(args.trace, cost, args.model)
    options = {**default_options(args.repo, cost), **parse_sets(args.set)}
    res = simulate(reqs, options, cost.step_seconds(int(options["threads"])), cost.kv_bytes_per_token,
                   rate_scale=args.rate_scale)
    say(json.dumps({"options": {k: options[k] for k in TUNED}, "figures": res.figures}, indent=1))
    return 0


def cmd_search(args) -> int:
    from tuner import config_writer
    from tuner import trace as traces
    from tuner.cost import CostModel
    from tuner.report import search_report
    from tuner.search import DEFAULT_GRID, MAX_SCALE, search

    args.out.mkdir(parents=True, exist_ok=True)
    cost = CostModel.load(args.cost)
    trace, reqs, _ = load_trace(args.trace, cost, args.model)
    rate = traces.offered_rate(trace)
    sla = {"ttft_p99_ms": args.ttft_p99_ms, "itl_p99_ms": args.itl_p99_ms, "rate": rate}
    grid = {**DEFAULT_GRID, **{k: v if isinstance(v, list) else [v] for k, v in parse_sets(args.grid).items()}}
    if "threads" in grid:
        cost_threads = set(cost.threads)
        grid["threads"] = [t for t in grid["threads"] if t in cost_threads]
    default = default_options(args.repo, cost)
    base = {**default, **{k: v for k, v in parse_sets(args.set).items()}}
    say(f"[search] {len(trace)} requests at {rate:.2f} req/s; SLA p99 TTFT <= {args.ttft_p99_ms} ms, "
        f"p99 ITL <= {args.itl_p99_ms} ms")
    res = search(reqs, cost, sla, grid, default, base, workers=args.workers, progress=say)
    chosen = {k: res.chosen[k] for k in TUNED if k in res.chosen}
    header = (f"Tuned by {PROG} search ({datetime.date.today()}): p99 TTFT <= {args.ttft_p99_ms:g} ms, "
              f"p99 ITL <= {args.itl_p99_ms:g} ms at {rate:.2f} req/s on {args.trace.name}\n"
              f"(predicted highest rate meeting it: {res.max_rate_scale * rate:.2f} req/s).\n"
              f"Serve with: tritonserver --model-repository model_repository --model-config-name={args.name}\n"
              f"and OMP_NUM_THREADS={chosen.get('threads')} in the server's environment (threads per engine).\n"
              f"Generated from llm/config.pbtxt: only parameter values differ. Report: {args.out}/report.md")
    config_path = None
    if not args.no_write_config:
        config_path = config_writer.write(args.repo, args.name, chosen, header)
        say(f"[search] wrote {config_path}")
    mr = res.max_rate_eval.figures if res.max_rate_eval else None
    summary = {
        "name": args.name, "chosen": chosen, "sla": sla,
        "predicted": res.chosen_at_rate.figures, "sla_met_predicted": res.chosen_at_rate.ok,
        "max_rate": {"rate": res.max_rate_scale * rate, "multiplier": res.max_rate_scale, "predicted": mr,
                     "at_cap": res.max_rate_scale >= MAX_SCALE},
        "default": {"options": {k: default[k] for k in TUNED}, "predicted": res.default.figures,
                    "meets_sla": res.default.ok,
                    "max_rate": {"rate": res.default_max_rate_scale * rate,
                                 "multiplier": res.default_max_rate_scale}},
        "config_path": str(config_path.relative_to(ROOT) if config_path and config_path.is_relative_to(ROOT)
                           else config_path),
        "search": {"configs": len(res.grid), "grid_seconds": res.grid_seconds,
                   "configs_per_s": len(res.grid) / res.grid_seconds, "simulations": res.num_simulations,
                   "seconds": res.seconds, "workers": args.workers or os.cpu_count(), "grid": grid},
        "cost": {"path": str(args.cost), "host": f"{cost.data['host']['cpu']}, {cost.data['host']['cpus']} CPUs",
                 "code_version": cost.data["code_version"],
                 "server_step_scale": {str(t): cost.server_scale_for(t) for t in cost.threads},
                 "fit": {t: f.stats for t, f in cost.fits.items()}},
        "trace": {"path": str(args.trace), "requests": len(trace),
                  "output_tokens": sum(r.output_tokens for r in trace),
                  "sha256": hashlib.sha256(args.trace.read_bytes()).hexdigest()[:16]},
        "repo": str(args.repo),
    }
    write_summary(args.out, summary)
    search_report(json.loads((args.out / "summary.json").read_text()), res, args.out)
    say(f"[search] chosen {chosen}: predicted {res.chosen_at_rate.figures['output_tok_s']:.1f} tok/s, p99 TTFT "
        f"{res.chosen_at_rate.figures['ttft_p99_ms']:.0f} ms, p99 ITL {res.chosen_at_rate.figures['itl_p99_ms']:.0f} "
        f"ms; SLA held up to {res.max_rate_scale * rate:.2f} req/s (default: {res.default_max_rate_scale * rate:.2f})")
    say(f"[search] {len(res.grid)} configs in {res.grid_seconds:.1f} s; report {args.out / 'report.md'}")
    return 0


# ---- verify --------------------------------------------------------------------------------------------------
def cmd_verify(args) -> int:
    from tuner import trace as traces
    from tuner.cost import CostModel
    from tuner.report import verify_report
    from tuner.sim import SimRequest, meets, simulate
    from tuner.verify import serve_and_replay

    summary = json.loads((args.out / "summary.json").read_text())
    trace_path = args.trace or Path(summary["trace"]["path"])
    repo = args.repo or Path(summary.get("repo") or DEFAULT_REPO)
    cost = CostModel.load(Path(summary["cost"]["path"]))
    trace, reqs, tok = load_trace(trace_path, cost, args.model)
    start, end = args.start, args.start + args.duration
    before = [i for i, r in enumerate(trace) if r.arrival_s < start]
    keep = [i for i, r in enumerate(trace) if start <= r.arrival_s < end] or [len(before)]
    warm_texts = [traces.prompt_text(trace[i], tok) for i in before]  # the window's past: the prefix cache
    trace, reqs = [trace[i] for i in keep], [reqs[i] for i in keep]
    texts = [traces.prompt_text(r, tok) for r in trace]
    t0 = trace[0].arrival_s if start else 0.0
    sends = [(r.arrival_s - t0, t, r.output_tokens, r.priority) for r, t in zip(trace, texts)]
    reqs = [SimRequest(r.arrival_s - t0, r.prompt_ids, r.output_tokens, r.priority) for r in reqs]
    # Served before the timed replay, on the server and (the same prompts, 4 tokens each) in the simulator.
    warm = warm_texts + [texts[0], "The capital of France is"]
    warm_reqs = [SimRequest(0.0, list(ids), 4) for ids in tok(warm)["input_ids"]]
    sla = summary["sla"]
    chosen = summary["chosen"]
    default = {**default_options(repo, cost), **summary["default"]["options"]}
    base = default_options(repo, cost)

    def predict(options, slowdown: float = 1.0):
        """The simulator on exactly the replayed requests; slowdown scales every step's modelled time."""
        step_cost = cost.step_seconds(int(options["threads"]))
        res = simulate(reqs, options, (lambda sch: slowdown * step_cost(sch)) if slowdown != 1.0 else step_cost,
                       cost.kv_bytes_per_token, warm=warm_reqs)
        return res.figures

    pred = predict({**base, **chosen})
    dpred = predict(default)
    drain = args.drain if args.drain is not None else max(60.0, args.duration)
    runs = [("chosen", summary["name"], chosen.get("threads")), ("default", None, None)]
    if args.default_first:
        runs.reverse()
    measured = {}
    for label, config_name, threads in runs:
        with timed_section(args):
            say(f"[verify] {label}: {len(sends)} requests over {sends[-1][0]:.0f} s")
            measured[label] = serve_and_replay(repo, config_name, threads, sends, drain,
                                               args.out / f"server-{label}.log", warm, say)
        m = measured[label]
        say(f"[verify] {label}: {m['output_tok_s']:.1f} tok/s, p99 TTFT {m['ttft_p99_ms']:.0f} ms, p99 ITL "
            f"{m['itl_p99_ms']:.0f} ms ({m['requests_done']}/{m['requests']} done)")
    # Where the error comes from: re-predict with every step slowed by the measured/predicted mean step time.
    # If these match the measurements, the scheduling is modelled right and the gap is the step cost (a busy
    # host, the server's own work between steps); if not, the simulator misses something.
    drift = {label: measured[label]["step_mean_ms"] / p["step_mean_ms"]
             for label, p in (("chosen", pred), ("default", dpred)) if p["step_mean_ms"] and
             measured[label].get("step_mean_ms")}
    rescaled = {label: predict(opts, drift[label]) for label, opts in (("chosen", {**base, **chosen}),
                                                                      ("default", default)) if label in drift}
    summary["measured"] = measured["chosen"]
    summary["default_measured"] = measured["default"]
    summary["verification"] = {
        "trace": str(trace_path), "start_s": args.start, "duration_s": args.duration, "requests": len(sends),
        "warm_up_requests": len(warm),
        "predicted_replay": pred, "default_predicted_replay": dpred,
        "sla_held": meets(measured["chosen"], sla), "default_sla_held": meets(measured["default"], sla),
        "predicted_sla_held": meets(pred, sla), "default_predicted_sla_held": meets(dpred, sla),
        "errors": {k: (measured["chosen"][k] - pred[k]) / pred[k] for k in ("output_tok_s", "ttft_p99_ms",
                                                                          "itl_p99_ms") if pred[k]},
        "default_errors": {k: (measured["default"][k] - dpred[k]) / dpred[k]
                           for k in ("output_tok_s", "ttft_p99_ms", "itl_p99_ms") if dpred[k]},
        "step_time_ratio": drift,
        "threads": {"chosen": int(chosen.get("threads") or default["threads"]), "default": int(default["threads"])},
        "server_step_scale_used": {k: cost.server_scale_for(t) for k, t in (
            ("chosen", int(chosen.get("threads") or default["threads"])), ("default", int(default["threads"])))},
        "step_time_ratio_to_engine": {k: v * cost.server_scale_for(
            int(chosen.get("threads") or default["threads"]) if k == "chosen" else int(default["threads"]))
            for k, v in drift.items()},
        "predicted_replay_rescaled": rescaled.get("chosen"),
        "default_predicted_replay_rescaled": rescaled.get("default"),
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    write_summary(args.out, summary)
    verify_report(summary, args.out)
    say(f"[verify] wrote {args.out / 'verify.md'}")
    return 0


# ---- prefixes ------------------------------------------------------------------------------------------------
def cmd_prefixes(args) -> int:
    from tuner import trace as traces
    from tuner.prefixes import recommend, table
    from tuner.report import prefix_report

    args.out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_of(args.model)
    kv_bytes = kv_bytes_per_token(args.model)
    try:  # a trace (synthetic prompts materialized) or a plain prompt log
        texts = [traces.prompt_text(r, tok) for r in traces.load(args.log)]
    except traces.TraceError:
        texts = [p for _, p, _ in traces.read_prompt_log(args.log)]
    prompts = [list(ids) for ids in tok(texts)["input_ids"]]
    say(f"[prefixes] {len(prompts)} prompts, {sum(map(len, prompts))} tokens")
    rows = table(prompts, args.block_sizes, args.pools_mib, kv_bytes, args.in_flight, say)
    pool = args.pool_mib if args.pool_mib in args.pools_mib else args.pools_mib[-1]
    choice, reasons = recommend(rows, pool)
    best = next(r for r in rows if r.block_size == choice["block_size"] and r.pool_mib == pool)
    if args.cost:  # what the saved prefill is worth on this host
        from tuner.cost import CostModel
        cost = CostModel.load(args.cost)
        threads = min(cost.threads)
        ms = cost.fits[threads].coef_ms["tokens"]
        reasons.append(f"that is about {best.hit_tokens * ms / 1e3:.0f} s of prefill compute saved over the log "
                       f"({ms:.2f} ms a token at {threads} thread(s), {cost.data['host']['cpu']})")
    prefix_report(str(args.log), rows, choice, reasons, len(prompts), sum(map(len, prompts)), args.in_flight,
                  args.out)
    write_summary(args.out, {"chosen": choice, "reasons": reasons,
                             "predicted": {"prefix_hit_rate": best.hit_rate, "prefill_tokens_saved": best.hit_tokens},
                             "table": [{**vars(r), "hit_rate": r.hit_rate} for r in rows]})
    say(f"[prefixes] recommend {choice}; report {args.out / 'report.md'}")
    return 0


def cmd_server_scale(args) -> int:
    """Record in cost.json how much slower a step is in tritonserver than alone, per torch thread count: the mean
    over verify runs of measured / modelled engine step time. search, simulate and verify then predict the
    server."""
    from tuner.cost import CostModel

    cost = CostModel.load(args.cost)
    by_threads: dict[str, list[float]] = {}
    sources = []
    for d in args.source:
        summary = json.loads((d / "summary.json").read_text())
        v = summary["verification"]
        threads = v.get("threads") or {"chosen": int(summary["chosen"]["threads"]),
                                       "default": int(summary["default"]["options"]["threads"])}
        used = v.get("server_step_scale_used", 1.0)
        r = {k: x * (used[k] if isinstance(used, dict) else used) for k, x in v["step_time_ratio"].items()}
        for k, x in r.items():
            by_threads.setdefault(str(threads[k]), []).append(x)
        sources.append({"dir": str(d), "ratios": r, "threads": threads, "when": v.get("when")})
    scale = {t: round(sum(x) / len(x), 3) for t, x in sorted(by_threads.items())}
    cost.data["server"] = {"step_scale": scale, "sources": sources,
                           "note": f"server step time / engine step time measured by {PROG} verify, "
                                   "per torch thread count"}
    cost.save(args.cost)
    say(f"[server-scale] {args.cost}: step_scale " + ", ".join(
        f"{t} thread(s) {x} (from {', '.join(f'{y:.3f}' for y in by_threads[t])})" for t, x in scale.items()))
    return 0


def cmd_refresh_configs(args) -> int:
    from tuner import config_writer

    for path in config_writer.tuned_configs(args.repo):
        say(f"[refresh] {path}: {'rewritten' if config_writer.refresh(args.repo, path) else 'up to date'}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def add_quiet(p) -> None:
    p.add_argument("--lock", help="hold this flock file during each timed part, not between them "
                   "(e.g. /tmp/cpu-heavy.lock)")
    p.add_argument("--quiet-load", type=float, help="before each timed part, wait for the 1-minute load average "
                   "to fall below this (a shared machine)")
    p.add_argument("--quiet-wait-s", type=float, default=600, help="... but at most this long (default 600)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("calibrate", help="time engine steps, fit the cost model -> OUT/cost.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--threads", type=_ints, default=[1, 2], help="torch thread counts to calibrate (default 1,2)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per shape (median kept)")
    p.add_argument("--quick", action="store_true", help="a small grid (smoke tests)")
    p.add_argument("--retries", type=int, default=3, help="re-measure a shape slowed by other work up to N times")
    p.add_argument("--keep-other-threads", action="store_true",
                   help="keep OUT/cost.json's fits for thread counts not measured now (same host, model, code)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by wall clock (default) or by process CPU time (1 thread, on a busy machine)")
    add_quiet(p)
    p.set_defaults(fn=cmd_calibrate)

    p = sub.add_parser("refit", help="fit a cost.json's measured points again (no new measurements)")
    p.add_argument("--cost", type=Path, required=True)
    p.set_defaults(fn=cmd_refit)

    p = sub.add_parser("calibrate-worker", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.set_defaults(fn=cmd_calibrate_worker)

    p = sub.add_parser("trace", help="write a JSONL trace from a named mix or a prompt log")
    p.add_argument("--mix", default="seed", help="seed, long_tail or chat")
    p.add_argument("--from-log", type=Path, help="a prompt log (JSONL with prompt, or text lines) instead of a mix")
    p.add_argument("--rate", type=float, required=True, help="mean requests per second")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--scale", type=float, default=1.0, help="scales the mix's output lengths (this CPU: ~0.15)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 Poisson, <1 bursty")
    p.add_argument("--output-tokens", type=int, default=64, help="with --from-log: when a line gives none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="its tokenizer sizes the synthetic prompts")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(fn=cmd_trace)

    for name, fn in (("simulate", cmd_simulate), ("search", cmd_search)):
        p = sub.add_parser(name)
        p.add_argument("--cost", type=Path, required=True)
        p.add_argument("--trace", type=Path, required=True)
        p.add_argument("--model", type=Path, help="tokenizer (default: the cost model's model)")
        p.add_argument("--repo", type=Path, default=DEFAULT_REPO, help="model repository (default config, output)")
        p.add_argument("--set", action="append", help="engine option=value over the default config (repeatable)")
        p.set_defaults(fn=fn)
    sim = sub.choices["simulate"]
    sim.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times faster")
    srch = sub.choices["search"]
    srch.add_argument("--ttft-p99-ms", type=float, required=True)
    srch.add_argument("--itl-p99-ms", type=float, required=True)
    srch.add_argument("--name", required=True, help="writes REPO/llm/configs/NAME.pbtxt")
    srch.add_argument("--out", type=Path, required=True)
    srch.add_argument("--grid", action="append", help="option=v1,v2,... replacing that option's grid (repeatable)")
    srch.add_argument("--workers", type=int, default=0, help="simulation processes (default: CPU count)")
    srch.add_argument("--no-write-config", action="store_true")

    p = sub.add_parser("verify", help="serve chosen and default configs, replay the trace, compare with predictions")
    p.add_argument("--out", type=Path, required=True, help="the search's folder (summary.json)")
    p.add_argument("--trace", type=Path, help="default: the search's trace")
    p.add_argument("--duration", type=float, required=True, help="replay the requests arriving in the first S seconds")
    p.add_argument("--start", type=float, default=0.0,
                   help="... from this second of the trace on; the prompts before it warm the prefix cache first "
                   "(server and simulator), as a server that has been running would have it")
    p.add_argument("--drain", type=float, help="seconds to wait for the last requests (default max(60, duration))")
    p.add_argument("--repo", type=Path)
    p.add_argument("--model", type=Path)
    p.add_argument("--default-first", action="store_true", help="serve the default config first")
    add_quiet(p)
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser("prefixes", help="prefix-cache hit rates of a prompt log per block size and pool")
    p.add_argument("log", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--block-sizes", type=_ints, default=[8, 16, 32, 64])
    p.add_argument("--pools-mib", type=_floats, default=[32, 128, 512])
    p.add_argument("--pool-mib", type=float, default=512, help="the pool the recommendation is made for")
    p.add_argument("--in-flight", type=int, default=16, help="requests holding blocks at once")
    p.add_argument("--cost", type=Path, help="a cost.json: also say how much prefill time the hits save")
    p.set_defaults(fn=cmd_prefixes)

    p = sub.add_parser("server-scale", help="record the server's step-time factor (from verify runs) in cost.json")
    p.add_argument("--cost", type=Path, required=True)
    p.add_argument("source", type=Path, nargs="+", help="verified search folders (summary.json)")
    p.set_defaults(fn=cmd_server_scale)

    p = sub.add_parser("refresh-configs", help="re-render tuned configs after llm/config.pbtxt changed (values kept)")
    p.add_argument("--repo", type=Path, default=DEFAULT_REPO)
    p.set_defaults(fn=cmd_refresh_configs)

    args = ap.parse_args(argv)
    return args.fn(args)


def run() -> None:
    """The console entry (`python -m tuner`): main, its run time, its exit status."""
    t0 = time.perf_counter()
    rc = main()
    say(f"[tune] done in {time.perf_counter() - t0:.1f} s")
    sys.exit(rc)
