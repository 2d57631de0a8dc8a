"""Soak: minutes to hours of mixed traffic, sampling every stub's memory and every engine's KV pool as it goes.

    .venv/bin/python -m perf.soak --minutes 30 --concurrency 4 --name smol-30m     # its own server, on the host
    .venv/bin/python -m perf.soak --seconds 40 --tiny --name quick                  # tiny-llama (the test suite)
    .venv/bin/python -m perf.soak --image llm-triton:cpu --minutes 5 --prometheus --name image-5m
    .venv/bin/python -m perf.soak --image llm-triton:cpu --minutes 120 --prometheus --name image-2h
    .venv/bin/python -m perf.soak --minutes 10 --grpc-url localhost:8001 --http-url http://localhost:8000 \\
        --metrics-url http://localhost:8002/metrics --stub-pid 1234                  # a running server

On the host it drives `llm` with the "host" mix (perf/soak/traffic.py). With --image it runs the CPU image under
podman (as `make test-docker` builds it) with --instances engines per engine model (default 2) and drives both
A/B arms and the OpenAI API with the "image" mix: cancels, disconnects, bad inputs, OpenAI streaming, priorities.
--prometheus runs Prometheus (Debian's package, scripts/setup_docker.sh) with docker/prometheus/ (the alert
rules included) scraping the server, and reports every alert that went pending or fired.

Writes perf/results/soak-<name>/: report.md, samples.csv (one row per sample), requests.csv (one row per
request), summary.json, rss.png (if matplotlib is there). Exit status 1 when any request did not get exactly
one final, a block leaked (any engine instance), the servers' request counts disagree with the clients', the
models are not quiescent, a process's RSS grew past --rss-growth-limit-pct after the warm-up (in a run of
5 minutes or more), an alert fired, or the server did not stop cleanly.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import urllib.request
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from perf.soak.report import RSS_GROWTH_LIMIT_PCT, Accounting, Sample, summarize, write_outputs
from perf.soak.traffic import ENGINE_BOUND, MIXES, Endpoints, Traffic, finals_check
from server_harness.container import ImageServer, podman, repository_with
from server_harness.prometheus import run_prometheus, scrape_config
from server_harness.host import cpu_model_name, rss_mb
from server_harness.quiescence import ENGINE_ZERO_GAUGES, ZERO_GAUGES, quiescence_problems, scrape
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer, free_ports
from server_harness.stub_watch import server_stubs

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "docker" / "prometheus"
FINISHED = "vllm:request_success_total"
ENGINE_MODELS = ("llm", "llm_dynamic")
_SAMPLE = re.compile(r"^((?:vllm|inflight):[a-zA-Z0-9_:]+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def by_instance(metrics_url: str) -> dict[str, dict[str, float]]:
    """Engine instance (llm_0_1, llm_dynamic_0_0) -> its vllm:/inflight: gauges, unlabelled ones only."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if labels.get("model") in ENGINE_MODELS and set(labels) == {"model", "version", "instance"}:
            out.setdefault(labels["instance"], {})[m.group(1)] = float(m.group(3))
    return out


class Probe:
    """Where the samples come from: host pids of the processes to weigh, and the engines' metrics."""

    def __init__(self, ep: Endpoints, processes):
        self.ep = ep
        self.processes = processes  # () -> {name: host pid}

    def finished_total(self) -> float:
        total = 0.0
        for model in ENGINE_MODELS:
            m = scrape(self.ep.metrics_url, model)
            total += sum(v for k, v in m.items() if k.startswith(FINISHED + "{"))
        return total

    def sample(self, t0: float, traffic: Traffic) -> Sample:
        gauges = by_instance(self.ep.metrics_url)
        llm = scrape(self.ep.metrics_url, "llm")
        rss = {name: rss_mb(pid) for name, pid in self.processes().items()
               if name in ("tritonserver",) or name.startswith(("llm", "pre", "post"))}
        return Sample(
            t_s=round(time.monotonic() - t0, 1), rss_mb={k: v for k, v in rss.items() if v is not None},
            kv={inst: (g.get("inflight:kv_blocks_used", 0.0), g.get("inflight:kv_blocks_free", 0.0))
                for inst, g in gauges.items() if "inflight:kv_blocks_free" in g},
            running=llm.get("vllm:num_requests_running"), waiting=llm.get("vllm:num_requests_waiting"),
            inflight=llm.get("inflight:num_requests_inflight"), finished=self.finished_total(),
            preemptions=llm.get("vllm:num_preemptions_total"), requests_sent=sum(traffic.counts().values()))


def gauges_of(model: str) -> tuple[str, ...]:
    """llm_dynamic has no frontend, so no inflight:num_requests_inflight gauge (server_harness.quiescence)."""
    return ENGINE_ZERO_GAUGES if model == "llm_dynamic" else ZERO_GAUGES


def wait_quiescent(ep: Endpoints, models: dict[str, int], timeout_s: float, settle_s: float) -> list[str]:
    """models: name -> blocks of all its instances together."""
    deadline = time.monotonic() + timeout_s
    good_since = None
    while True:
        problems = [p for model, blocks in models.items()
                    for p in quiescence_problems(ep, model, blocks, gauges_of(model))]
        now = time.monotonic()
        good_since = None if problems else (good_since or now)
        if good_since is not None and now - good_since >= settle_s:
            return []
        if now > deadline:
            return problems or ["flapping"]
        time.sleep(0.2)


def parse_mix(text: str) -> dict[str, float]:
    """"ens_stream=3,ens_cancel=1" -> weights by action; every action must be one the traffic knows."""
    known = set().union(*MIXES.values())
    mix: dict[str, float] = {}
    for part in text.split(","):
        action, _, weight = part.partition("=")
        action = action.strip()
        if action not in known:
            raise argparse.ArgumentTypeError(f"mix: unknown action {action!r}; known: {', '.join(sorted(known))}")
        try:
            mix[action] = float(weight) if weight else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"mix: weight of {action} must be a number, got {weight!r}") from None
        if mix[action] <= 0:
            raise argparse.ArgumentTypeError(f"mix: weight of {action} must be > 0, got {weight}")
    return mix


def key_value(text: str) -> tuple[str, str]:
    """"KEY=VALUE" -> (KEY, VALUE), for --env."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"env: expected KEY=VALUE, got {text!r}")
    return key, value


def host_server(args, work: Path) -> TritonServer:
    model_dir = ROOT / "models" / ("tiny-llama" if args.tiny else "SmolLM2-135M-Instruct")
    repo = make_model_repository(ROOT / "model_repository", work / "repo", {"llm": {
        "model": model_dir, "num_kv_blocks": args.num_kv_blocks, "max_model_len": 1024,
        "metrics_interval_ms": int(args.metrics_interval_s * 1000), "default_max_tokens": 64}})
    server = TritonServer(repo, log_path=work / "server.log")
    print(f"==> starting tritonserver ({model_dir.name}); log {server.log_path}", flush=True)
    return server.start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float)
    length.add_argument("--seconds", type=float)
    p.add_argument("--concurrency", type=int, default=None, help="clients (default 4 on the host, 6 in the image)")
    p.add_argument("--max-tokens", type=int, default=48, help="upper bound of the random max_tokens")
    p.add_argument("--name", default=None)
    p.add_argument("--results-dir", type=Path, default=ROOT / "perf" / "results")
    p.add_argument("--tiny", action="store_true", help="tiny-llama instead of SmolLM2-135M-Instruct (host only)")
    p.add_argument("--num-kv-blocks", type=int, default=256, help="per engine instance")
    p.add_argument("--sample-s", type=float, default=None, help="seconds between samples (default: duration/60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image", help="run this CPU image under podman (both arms, OpenAI API) instead of the host")
    p.add_argument("--instances", type=int, default=2, help="instances of each engine model (--image)")
    p.add_argument("--prometheus", action="store_true", help="scrape with Prometheus and evaluate the alert rules")
    p.add_argument("--grpc-url", help="use a running server (host:port) instead of starting one")
    p.add_argument("--http-url")
    p.add_argument("--metrics-url")
    p.add_argument("--model", default="llm")
    p.add_argument("--stub-pid", type=int, help="the model's python-backend stub, for its RSS (--grpc-url mode)")
    p.add_argument("--metrics-interval-s", type=float, default=1.0)
    p.add_argument("--rss-growth-limit-pct", type=float, default=RSS_GROWTH_LIMIT_PCT,
                   help="fail the run when any process's RSS grows by more than this after the warm-up "
                        "(default %(default)s)")
    p.add_argument("--mix", type=parse_mix, default=None,
                   help="actions and weights instead of the host or image mix, e.g. ens_stream=3,ens_cancel=1 "
                        "(to find which request path grows a process)")
    p.add_argument("--env", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="set in the container (--image), e.g. MALLOC_CONF=...; repeatable")
    args = p.parse_args(argv)
    duration = args.seconds if args.seconds is not None else 60 * (args.minutes or 1)
    args.concurrency = args.concurrency or (6 if args.image else 4)
    name = args.name or datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.results_dir / f"soak-{name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    every = args.sample_s or max(2.0, duration / 60)
    standard = "image" if args.image else "host"
    mix = args.mix or dict(MIXES[standard])
    mix_name = ",".join(f"{a}={w:g}" for a, w in args.mix.items()) if args.mix else standard

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        stopped: dict = {}
        if args.image:
            repo = repository_with(ROOT / "model_repository", work / "repo", args.instances,
                                   {"num_kv_blocks": args.num_kv_blocks})
            server = ImageServer(args.image, repository=repo, env=dict(args.env)).start()
            print(f"==> container {server.name} of {args.image} ready ({args.instances} instances per engine)",
                  flush=True)
            stack.callback(lambda: stopped.update(server.stop()))
            ep = Endpoints("llm", server.grpc_url, server.http_base, server.metrics_url,
                           openai_base=server.openai_base)
            probe = Probe(ep, server.processes)
            models = {m: args.num_kv_blocks * args.instances for m in ENGINE_MODELS}
            where, model_name = f"container of {args.image}", "SmolLM2-135M-Instruct (the image's)"
        elif args.grpc_url:
            ep = Endpoints(args.model, args.grpc_url, args.http_url.rstrip("/"), args.metrics_url)
            probe = Probe(ep, lambda: {f"{args.model}_0_0": args.stub_pid} if args.stub_pid else {})
            blocks = int(sum(scrape(ep.metrics_url, ep.model).get(k, 0) for k in
                             ("inflight:kv_blocks_used", "inflight:kv_blocks_free")))
            models, where, model_name = {args.model: blocks}, args.grpc_url, args.model
        else:
            host = host_server(args, work)
            stack.callback(host.stop)
            ep = Endpoints("llm", host.grpc_url, host.http_base, host.metrics_url)
            probe = Probe(ep, lambda: {"tritonserver": host.pid, **{s.instance: pid for pid, s in
                                                                     server_stubs(host.pid).items()}})
            models = {"llm": args.num_kv_blocks}
            where = "started by perf.soak"
            model_name = "tiny-llama" if args.tiny else "SmolLM2-135M-Instruct"
        prom = None
        if args.prometheus:
            (port,) = free_ports(1)
            target = ep.metrics_url.split("//", 1)[1].split("/", 1)[0]
            config = scrape_config(PROMETHEUS / "prometheus.yml", PROMETHEUS / "alerts.yml", [target], "5s", "15s")
            prom = stack.enter_context(run_prometheus(work / "prometheus", port, config))
        def keep_container_log() -> None:  # the container goes with the stack: keep its log for the post-mortem
            (out_dir / "server.log").write_text(server.logs()[-1_000_000:])
            print(f"==> the container's log: {out_dir / 'server.log'}", flush=True)

        try:
            result = soak(args, ep, duration, every, probe, models, mix, prom)
        except BaseException:
            if args.image:
                keep_container_log()
            raise
        if args.image and result["summary"]["metrics_unreachable"]:
            keep_container_log()
        if args.image:
            health = podman("healthcheck", "run", server.name, check=False)
            result["summary"]["healthcheck_at_end"] = "healthy" if health.returncode == 0 else health.stdout.strip()
    leftovers = list(host.leftovers()) if not args.image and not args.grpc_url else []
    if stopped:
        result["summary"]["container_stop"] = {k: v for k, v in stopped.items() if k != "log_tail"}
        if stopped["exit_code"] != 0 or not stopped["stopped_cleanly"]:
            leftovers.append(f"container stop: exit code {stopped['exit_code']}, clean {stopped['stopped_cleanly']}: "
                             f"{stopped['log_tail'][-600:]}")
    result["summary"]["leftovers"] = leftovers
    config = {"duration_s": duration, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "model": model_name, "num_kv_blocks": args.num_kv_blocks, "seed": args.seed, "server": where,
              "instances": args.instances if args.image else 1, "mix": mix_name, "prometheus": args.prometheus,
              "sample_every_s": every, "started": result["started"], "cpu": cpu_model_name()}
    write_outputs(out_dir, config, result["summary"], result["samples"], result["outcomes"])
    s = result["summary"]
    print(json.dumps({k: s[k] for k in ("requests", "missing_finals", "duplicate_finals", "leaked_blocks",
                                        "server_count_mismatch", "failed_outcomes", "stub_rss_growth_mb",
                                        "rss_growth_max_pct")}))
    print(f"==> report: {out_dir / 'report.md'}")
    fired = [a for a in s["alerts"] if a["state"] == "firing"]
    return 0 if s["passed"] and not s["leftovers"] and not fired else 1


def soak(args, ep: Endpoints, duration: float, every: float, probe: Probe, models: dict[str, int], mix: dict,
         prom) -> dict:
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    traffic = Traffic(ep, args.concurrency, args.max_tokens, args.seed, mix=dict(mix))
    before = probe.finished_total()
    t0 = time.monotonic()
    wall0 = time.time()
    samples = [probe.sample(t0, traffic)]
    unreachable: list[dict] = []  # samples the server did not answer: a restart, a hang; the run goes on
    runner = threading.Thread(target=traffic.run, args=(duration,), daemon=True)
    runner.start()
    while runner.is_alive():
        runner.join(every)
        try:
            samples.append(probe.sample(t0, traffic))
        except OSError as e:  # URLError, a refused or reset connection, a timeout
            unreachable.append({"t_s": round(time.monotonic() - t0, 1), "error": str(e)[:200]})
            print(f"  t={unreachable[-1]['t_s']:>6.0f}s metrics unreachable: {e}", flush=True)
            continue
        last = samples[-1]
        stubs = sum(v for k, v in last.rss_mb.items() if k != "tritonserver")
        print(f"  t={last.t_s:>6.0f}s sent={last.requests_sent} stubs_rss={stubs:.0f}MB "
              f"server_rss={last.rss_mb.get('tritonserver', 0):.0f}MB kv_used={last.kv_used} "
              f"inflight={last.inflight}", flush=True)
    problems = wait_quiescent(ep, models, timeout_s=120, settle_s=3 * args.metrics_interval_s)
    samples.append(probe.sample(t0, traffic))
    missing, duplicate, examples = finals_check(traffic.clients)
    for c in traffic.clients:
        c.close()
    engine_bound = sum(n for a, n in traffic.counts().items() if a in ENGINE_BOUND)
    accounting = Accounting(engine_bound=engine_bound, server_finished=probe.finished_total() - before,
                            pool_per_instance=args.num_kv_blocks, kv_end=samples[-1].kv, quiescence_problems=problems)
    summary = summarize(traffic.outcomes, samples, missing, duplicate, examples, accounting, t0, duration,
                        rss_growth_limit_pct=args.rss_growth_limit_pct)
    summary["metrics_unreachable"] = unreachable
    summary["passed"] = summary["passed"] and not unreachable
    if prom is not None:
        time.sleep(20)  # one more rule evaluation (15 s) after the traffic
        summary["alerts"] = alerts_seen(prom, wall0, time.time())
    return {"started": started, "summary": summary, "samples": samples, "outcomes": traffic.outcomes}


def alerts_seen(prom, start: float, end: float) -> list[dict]:
    """Every alert that was pending or firing at some evaluation during the run, with when."""
    out = []
    for series in prom.query_range("ALERTS", start, end, 15):
        labels = dict(series["metric"])
        times = [float(t) for t, _ in series["values"]]
        out.append({"name": labels.pop("alertname", "?"), "state": labels.pop("alertstate", "?"),
                    "from_s": times[0] - start, "to_s": times[-1] - start,
                    "labels": {k: v for k, v in labels.items() if k not in ("__name__", "severity")}})
    return out


if __name__ == "__main__":
    sys.exit(main())
