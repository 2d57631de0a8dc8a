"""A python-backend stub killed with SIGKILL under load (the OOM killer, a native fault), served by scripts/serve.py
as `make serve` and the image run it: what every request in flight sees, what readiness says meanwhile, and when
the server serves again.

    .venv/bin/python -m perf.faults.dead_stub --victim llm                 # SmolLM2; kill llm_0_0 under load
    .venv/bin/python -m perf.faults.dead_stub --victim llm_dynamic
    .venv/bin/python -m perf.faults.dead_stub --victim llm --no-restart    # what Triton 2.51 does by itself

Load: --clients streams per arm (`llm` and `llm_ensemble`), each sending one long streamed request after another
on a fresh gRPC stream. --victim's first instance is killed once every client has a request in flight. Every
request must end within --deadline-s of the kill: with a final (data or an error naming the cause) or with its
stream closed by the server's restart; one that does neither is a hang. Readiness (Triton's /v2/health/ready,
the victim's /v2/models/<victim>/ready, and the container probes' verdicts, scripts/health.py) is sampled every
0.25 s. With --no-restart serve.py leaves the dead stub alone (RESTART_ON_STUB_DEATH=0), as Triton does.
Writes perf/results/faults-dead-stub-<name>/ (report.md, summary.json, timeline.csv); exit 1 on a hang, a
request with more than one final, or no service again within --deadline-s; with --no-restart, when the liveness
probe never fails (the requests on the dead stub never get an answer from Triton: that is what is measured).
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from server_harness.host import cpu_model_name
from server_harness.quiescence import http_status
from server_harness.repository import build_repository, copy_model, instances
from server_harness.serve_state import liveness, read_state, readiness
from server_harness.server import free_ports
from server_harness.stream_client import StreamClient
from server_harness.stub_watch import server_stubs, zombie_stubs

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "scripts" / "serve.py"
log = logging.getLogger("dead_stub")
ARMS = {"llm": "llm", "llm_dynamic": "llm_ensemble"}  # engine model -> the model clients call


@dataclass
class Flight:
    """One request: when it was sent and how it ended."""
    model: str
    rid: str
    sent_at: float
    outcome: str = "pending"  # finished | error final | stream closed | refused (not sent: server down) | hang
    detail: str = ""
    ended_at: float | None = None
    finals: int = 0


@dataclass
class Load:
    grpc_url: str
    clients: dict[str, int]  # model -> clients
    max_tokens: int
    deadline_s: float
    flights: list[Flight] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._client, args=(model, k), daemon=True)
                   for model, n in self.clients.items() for k in range(n)]
        for t in threads:
            t.start()
        return threads

    def stop(self) -> None:
        self._stop.set()

    def _client(self, model: str, k: int) -> None:
        n = 0
        while not self._stop.is_set():
            flight = Flight(model, f"{model}-{k}-{n}", time.monotonic())
            n += 1
            with self._lock:
                self.flights.append(flight)
            self._one(flight)

    def _one(self, flight: Flight) -> None:
        c = None
        try:
            c = StreamClient(self.grpc_url, anonymous_errors=True)  # one request per stream: an error without id is
            c.send(flight.model, flight.rid, "Write a long story about a lighthouse keeper.",  # its
                   {"max_tokens": self.max_tokens, "ignore_eos": True, "stream": True})
        except Exception as e:  # noqa: BLE001 - the server is down (restarting): the client's call fails at once
            if c is not None:
                c.close(cancel=True)
            flight.outcome, flight.detail = "refused", f"{type(e).__name__}: {e}"[:200]
            flight.ended_at = time.monotonic()
            time.sleep(0.5)
            return
        try:
            while not c.wait_finals(0.2, ids=[flight.rid]):
                if c.unmatched_errors:  # the stream broke: no final will ever come on it
                    flight.outcome, flight.detail = "stream closed", c.unmatched_errors[0][:200]
                    break
                if time.monotonic() - flight.sent_at > self.deadline_s:
                    flight.outcome, flight.detail = "hang", f"no answer in {self.deadline_s:.0f} s"
                    break
            rec = c.records[flight.rid]
            flight.finals = rec.num_finals
            if rec.num_finals:
                flight.outcome = "error final" if rec.error else "finished"
                flight.detail = (rec.error or "")[:300]
            flight.ended_at = time.monotonic()
        finally:
            c.close(cancel=True)
        if flight.outcome != "finished":
            time.sleep(0.5)  # as a client backs off: not hundreds of refusals a second while the server restarts


@dataclass
class Tick:
    t_s: float
    triton_ready: int
    model_ready: int
    probe_ready: bool
    probe_live: bool
    serve_state: str
    why_not_ready: str


def sample(http_base: str, victim: str, state_file: Path, t_kill: float, grace_s: float) -> Tick:
    state = read_state(state_file)
    now = time.time()
    triton_ready = http_status(f"{http_base}/v2/health/ready")
    dead = zombie_stubs(state.server_pid) if state and state.server_pid else []
    ready = readiness(state, now, triton_ready == 200, dead)
    live = liveness(state, now, http_status(f"{http_base}/v2/health/live") == 200, grace_s, 600)
    return Tick(round(time.monotonic() - t_kill, 2), triton_ready, http_status(f"{http_base}/v2/models/{victim}/ready"),
                ready.ok, live.ok, state.state if state else "none", "" if ready.ok else ready.why)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.faults.dead_stub", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--victim", choices=tuple(ARMS), default="llm")
    ap.add_argument("--no-restart", action="store_true", help="RESTART_ON_STUB_DEATH=0: Triton 2.51 on its own")
    ap.add_argument("--tiny", action="store_true", help="tiny-llama instead of SmolLM2-135M-Instruct")
    ap.add_argument("--instances", type=int, default=2, help="instances of each engine model")
    ap.add_argument("--clients", type=int, default=3, help="streams per arm")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--deadline-s", type=float, default=90.0, help="every request ends within this of the kill")
    ap.add_argument("--observe-s", type=float, default=40.0, help="--no-restart: how long to watch")
    ap.add_argument("--dead-stub-grace-s", type=float, default=10.0, help="the liveness probe's grace")
    ap.add_argument("--name", default=None)
    ap.add_argument("--results-dir", type=Path, default=ROOT / "perf" / "results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    name = args.name or f"{args.victim}{'-no-restart' if args.no_restart else ''}"
    out = args.results_dir / f"faults-dead-stub-{name}"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dead-stub-") as tmp:
        summary, ticks = run(args, Path(tmp))
        (out / "serve.log").write_text(Path(tmp, "serve.log").read_text(errors="replace")[-20000:])
    write(out, args, summary, ticks)
    log.info("%s: %s", out / "report.md", "PASSED" if summary["passed"] else "FAILED")
    return 0 if summary["passed"] else 1


def start_serve(args, work: Path) -> tuple[subprocess.Popen, dict]:
    model = ROOT / "models" / ("tiny-llama" if args.tiny else "SmolLM2-135M-Instruct")
    source = ROOT / "model_repository"
    repo = build_repository(source, work / "repo", {"model": model})
    for engine in ARMS:
        copy_model(source, engine, repo, params={"model": model}, edit=instances(args.instances))
    http, grpc, metrics = free_ports(3)
    env = {**os.environ, "MODEL_REPOSITORY": str(repo), "HTTP_PORT": str(http), "GRPC_PORT": str(grpc),
           "METRICS_PORT": str(metrics), "EXIT_TIMEOUT_SECS": "10", "OPENAI_PORT": "off",
           "SERVE_STATE_DIR": str(work), "RESTART_ON_STUB_DEATH": "0" if args.no_restart else "1"}
    log_file = open(work / "serve.log", "wb")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen([sys.executable, str(SERVE)], env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    deadline = time.monotonic() + 600
    while "tritonserver is ready" not in (work / "serve.log").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("serve.py did not get ready: " + (work / "serve.log").read_text()[-3000:])
        time.sleep(0.5)
    return proc, {"http": http, "grpc": grpc}


def run(args, work: Path) -> tuple[dict, list[Tick]]:
    proc, ports = start_serve(args, work)
    http_base, grpc_url = f"http://127.0.0.1:{ports['http']}", f"127.0.0.1:{ports['grpc']}"
    state_file = work / f"llm-serve-{ports['http']}.json"
    ticks: list[Tick] = []
    try:
        state = read_state(state_file)
        stubs = server_stubs(state.server_pid)
        victim_pid = next(pid for pid, s in stubs.items() if s.instance == f"{args.victim}_0_0")
        load = Load(grpc_url, {model: args.clients for model in ARMS.values()}, args.max_tokens, args.deadline_s)
        threads = load.start()
        # Every client's request is in flight (a token or two came) before the kill.
        time.sleep(8)
        t_kill = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        log.info("SIGKILL %s_0_0 (pid %d)", args.victim, victim_pid)
        served_again = None
        watch_until = t_kill + (args.observe_s if args.no_restart else args.deadline_s)
        while time.monotonic() < watch_until:
            tick = sample(http_base, args.victim, state_file, t_kill, args.dead_stub_grace_s)
            ticks.append(tick)
            if not args.no_restart and served_again is None and tick.probe_ready and tick.t_s > 1:
                served_again = tick.t_s
                watch_until = min(watch_until, time.monotonic() + 15)  # a few more seconds of traffic
            time.sleep(0.25)
        load.stop()
        for t in threads:
            t.join(args.deadline_s + 30)
        after = first_success_after(grpc_url, served_again is not None)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            serve_exit = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            serve_exit = proc.wait()
    return summarize(args, load, t_kill, ticks, served_again, after, serve_exit, work), ticks


def first_success_after(grpc_url: str, expect: bool) -> dict:
    """One request per arm once the probes say ready again: it must simply work."""
    out = {}
    for model in ARMS.values():
        c = StreamClient(grpc_url)
        try:
            c.send(model, "after", "Hello", {"max_tokens": 4, "stream": True})
            ok = c.wait_finals(60, ids=["after"])
            rec = c.records["after"]
            out[model] = "ok" if ok and not rec.error else (rec.error or "no final in 60 s")[:200]
        finally:
            c.close(cancel=True)
    return out if expect else {m: f"(not ready) {v}" for m, v in out.items()}


def summarize(args, load: Load, t_kill: float, ticks: list[Tick], served_again: float | None, after: dict,
              serve_exit: int, work: Path) -> dict:
    in_flight = [f for f in load.flights if f.sent_at < t_kill and (f.ended_at is None or f.ended_at > t_kill)]
    later = [f for f in load.flights if f.sent_at >= t_kill]
    outcomes: dict[str, dict[str, int]] = {}
    for f in in_flight:
        row = outcomes.setdefault(f.model, {})
        row[f.outcome] = row.get(f.outcome, 0) + 1
    details = sorted({f"{f.model}: {f.outcome}: {f.detail}" for f in in_flight if f.outcome != "finished"})
    not_ready_at = next((t.t_s for t in ticks if not t.probe_ready), None)
    triton_not_ready_at = next((t.t_s for t in ticks if t.triton_ready != 200), None)
    not_live_at = next((t.t_s for t in ticks if not t.probe_live), None)
    hangs = [f for f in load.flights if f.outcome in ("hang", "pending")]
    extra = [f for f in load.flights if f.finals > 1]
    log_text = (work / "serve.log").read_text(errors="replace")
    summary = {
        "victim": f"{args.victim}_0_0", "restart": not args.no_restart, "model": "tiny-llama" if args.tiny else
        "SmolLM2-135M-Instruct", "instances": args.instances, "clients_per_arm": args.clients,
        "in_flight_at_kill": len(in_flight), "in_flight_outcomes": outcomes, "in_flight_details": details[:20],
        "sent_after_kill": len(later),
        "after_kill_outcomes": {o: sum(1 for f in later if f.outcome == o) for o in {f.outcome for f in later}},
        "after_kill_details": sorted({f"{f.model}: {f.outcome}: {f.detail}" for f in later
                                      if f.outcome != "finished"})[:10],
        "hangs": len(hangs), "more_than_one_final": len(extra),
        "probe_not_ready_after_s": not_ready_at, "triton_not_ready_after_s": triton_not_ready_at,
        "probe_not_live_after_s": not_live_at,
        "triton_model_ready_while_dead_s": sum(0.25 for t in ticks if t.model_ready == 200 and t.serve_state !=
                                               "restarting" and not t.probe_ready),
        "serving_again_after_s": served_again, "first_requests_after": after, "serve_exit_code": serve_exit,
        "serve_log_lines": [line for line in log_text.splitlines() if line.startswith("==>") and
                            ("stub" in line or "restart" in line or "serving again" in line)][:10],
    }
    if args.no_restart:
        # Triton alone: requests on the dead stub are never answered (hangs are the finding, not a failure);
        # what must hold is that the liveness probe says so, for the orchestrator to restart the container.
        passed = not extra and not_live_at is not None
    else:
        passed = (not hangs and not extra and served_again is not None
                  and all(v == "ok" for v in after.values()))
    summary["passed"] = passed
    return summary


def write(out: Path, args, s: dict, ticks: list[Tick]) -> None:
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    with open(out / "timeline.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(asdict(ticks[0]).keys()) if ticks else [])
        w.writerows([list(asdict(t).values()) for t in ticks])
    cpu = cpu_model_name()
    fmt = lambda v: "never" if v is None else f"{v:.2f} s"  # noqa: E731
    lines = [f"# A dead `{s['victim']}` stub, {'restarted by serve.py' if s['restart'] else 'left alone'} — "
             f"{'PASSED' if s['passed'] else 'FAILED'}", "",
             f"`python -m perf.faults.dead_stub {' '.join(sys.argv[1:])}` on {cpu} (2 cores, shared); {s['model']}, "
             f"{s['instances']} instances of each engine, {s['clients_per_arm']} streaming clients per arm; "
             f"SIGKILL at t=0.", "",
             "| what | figure |", "|---|---|",
             f"| requests in flight at the kill | {s['in_flight_at_kill']} |"]
    for model, row in s["in_flight_outcomes"].items():
        lines.append(f"| ... on {model} | {', '.join(f'{k}: {v}' for k, v in sorted(row.items()))} |")
    lines += [f"| requests sent after the kill | {s['sent_after_kill']}: "
              f"{', '.join(f'{k}: {v}' for k, v in sorted(s['after_kill_outcomes'].items()))} |",
              f"| hangs (no final, no closed stream, within {args.deadline_s:.0f} s) | {s['hangs']} |",
              f"| requests with more than one final | {s['more_than_one_final']} |",
              f"| probe (scripts/health.py) not ready after | {fmt(s['probe_not_ready_after_s'])} |",
              f"| Triton's /v2/health/ready not 200 after | {fmt(s['triton_not_ready_after_s'])} |",
              f"| probe not live after | {fmt(s['probe_not_live_after_s'])} |",
              f"| ready again (probe) after | {fmt(s['serving_again_after_s'])} |",
              f"| a request per arm once ready again | {s['first_requests_after']} |",
              f"| serve.py exit code at the end (SIGINT) | {s['serve_exit_code']} |", "",
              "What the requests in flight saw:", ""] + [f"- {d}" for d in s["in_flight_details"]]
    if s["after_kill_details"]:
        lines += ["", "Requests sent after the kill that did not finish:", ""]
        lines += [f"- {d}" for d in s["after_kill_details"]]
    lines += ["", "serve.py said:", ""] + [f"    {line}" for line in s["serve_log_lines"]]
    lines += ["", "Readiness over time (every 0.25 s in timeline.csv); where it changed:", "",
              "| t (s) | Triton ready | model ready | probe ready | probe live | serve.py |",
              "|---|---|---|---|---|---|"]
    last = None
    for t in ticks:
        key = (t.triton_ready, t.model_ready, t.probe_ready, t.probe_live, t.serve_state)
        if key != last:
            lines.append(f"| {t.t_s:.2f} | {t.triton_ready} | {t.model_ready} | {t.probe_ready} | {t.probe_live} | "
                         f"{t.serve_state} |")
            last = key
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
