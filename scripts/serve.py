#!/usr/bin/env python3
"""`make serve`: run tritonserver on model_repository, print how to talk to it, stop it cleanly.

Environment: HTTP_PORT / GRPC_PORT / METRICS_PORT (default 8000 / 8001 / 8002), BIND_ADDRESS (default
127.0.0.1; 0.0.0.0 exposes the server to the network), MODEL_REPOSITORY (default model_repository),
EXIT_TIMEOUT_SECS (default 15), ADMIN_KEY (default: random per run), OPENAI_PORT (default 9000, "off": no
OpenAI-compatible API). Extra arguments go to tritonserver.
Ctrl-C or SIGTERM stops the server by its pid, then checks that none of its python-backend stubs and
none of their /dev/shm regions are left (and removes any that are).
Once it has served, a dead python-backend stub or a tritonserver that exits by itself makes serve.py restart
both (RESTART_ON_STUB_DEATH=0: leave a dead stub alone, for the orchestrator's liveness probe to act on); more
than MAX_RESTARTS_PER_HOUR (default 5) restarts and it gives up (exit 1). Its state, for the container probes
(scripts/health.py), is in $SERVE_STATE_DIR (default /tmp)/llm-serve-<HTTP_PORT>.json.
"""
from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# The readiness wait and the leftover checks are shared with the test harness (server_harness.server): stubs
# are found in /proc by name, and a stub's argv names its shm region and its server's pid.
from server_harness.process import (SHM_DIR, STUB_ARG_PARENT, STUB_ARG_SHM, TRITONSERVER, python_stubs, shm_regions,
                                    wait_ready)
from server_harness.serve_state import (FAILED, RESTARTING, SERVING, STARTING, STOPPING, ServeState, state_path,
                                        write_state)
from server_harness.stub_watch import StubWatch

ROOT = Path(__file__).resolve().parent.parent
# Admin-only endpoints need the header "admin-key: <ADMIN_KEY>" (on gRPC, Triton 2.51 prefixes it:
# "triton-grpc-protocol-admin-key"); inference, health, metadata, model config and statistics stay open
# (perf_analyzer and genai-perf read config and statistics).
RESTRICTED = "model-repository,shared-memory,trace,logging"
READY_TIMEOUT_S = 600.0  # for tritonserver to load the model repository and answer ready
# A restart after a dead stub: our models cancel their in-flight requests within about 1.5 s of SIGTERM (they
# see the endpoint close); the requests on the dead stub can never finish, and would hold Triton for its whole
# exit timeout. So tritonserver gets this long before SIGKILL, and its leftovers are cleaned up.
RESTART_GRACE_S = 5.0


def env_port(name: str, default: int) -> int:
    raw = os.environ.get(name, str(default))
    try:
        port = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is malformed: expected a port number in [1, 65535]") from None
    if not 1 <= port <= 65535:
        raise SystemExit(f"{name}={port} is out of range: allowed [1, 65535]")
    return port


def check_free(address: str, port: int, name: str) -> None:
    """Triton notices a taken port only after loading every model; say so at once instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError as e:
            raise SystemExit(f"{name}={port} on {address} is not available ({e.strerror}): "
                             f"set {name} to a free port") from None


def die_with_parent() -> None:
    """In the child: get SIGTERM if serve.py dies without stopping the server."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Stop(Exception):
    pass


def on_signal(signum, frame):
    raise Stop(signal.Signals(signum).name)


def our_stubs(server_pid: int) -> list[tuple[int, list[str]]]:
    return [(pid, argv) for pid, argv in python_stubs()
            if len(argv) > STUB_ARG_PARENT and argv[STUB_ARG_PARENT] == str(server_pid)]


def banner(host: str, http: int, grpc: int, metrics: int, admin_key: str) -> str:
    h = f"http://{host}:{http}"
    return f"""
==> tritonserver is ready (model repository: {os.environ.get('MODEL_REPOSITORY', 'model_repository')})
  stream tokens over gRPC:
    .venv/bin/python client/generate.py --url {host}:{grpc} "Why is the sky blue?" --max-tokens 64
  one response (HTTP generate):
    curl -s -X POST {h}/v2/models/llm/generate \\
      -d '{{"text_input": "Why is the sky blue?", "max_tokens": 64, "temperature": 0}}'
  streamed (server-sent events):
    curl -N -s -X POST {h}/v2/models/llm/generate_stream \\
      -d '{{"text_input": "Why is the sky blue?", "max_tokens": 64, "stream": true}}'
  metrics:  curl -s http://{host}:{metrics}/metrics | grep -E '^vllm:|^inflight:'
  admin endpoints ({RESTRICTED}) need the header  admin-key: {admin_key}
    (on gRPC Triton 2.51 expects it as  triton-grpc-protocol-admin-key: {admin_key})
  Ctrl-C stops the server.
"""


def stop(proc: subprocess.Popen, exit_timeout_s: int, stub_shm: set[str], shm_before: set[str],
         grace_s: float | None = None) -> int:
    """SIGTERM by pid, SIGKILL after the grace period (default: the exit timeout + 30 s); then look for and remove
    our leftovers."""
    problems = []
    grace_s = exit_timeout_s + 30 if grace_s is None else grace_s
    if proc.poll() is None:
        print(f"\n==> stopping tritonserver (pid {proc.pid})", flush=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            problems.append(f"tritonserver pid {proc.pid} ignored SIGTERM for {grace_s:g} s; sent SIGKILL "
                            "(an open gRPC stream holds a model until its client disconnects; a request on a dead "
                            "stub holds it for good)")
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 5
    while our_stubs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, argv in our_stubs(proc.pid):
        problems.append(f"python backend stub pid {pid} outlived the server: killed")
        stub_shm.add(argv[STUB_ARG_SHM])
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5  # until the killed ones are gone, or their regions look like live ones' below
    while our_stubs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    live_others = {argv[STUB_ARG_SHM] for _, argv in python_stubs() if len(argv) > STUB_ARG_SHM}
    for name in sorted((shm_regions() - shm_before) & stub_shm - live_others):
        problems.append(f"shared memory {SHM_DIR / name} left behind: removed")
        (SHM_DIR / name).unlink(missing_ok=True)
    for p in problems:
        print(f"==> {p}", file=sys.stderr)
    if not problems:
        print("==> stopped cleanly: no stub process or shared memory region left", flush=True)
    return 1 if problems else 0


# ---- OpenAI-compatible API (backend_src/openai_frontend, docs/openai.md) ---------------------------------
# OPENAI_PORT (default 9000; "off" disables it) on BIND_ADDRESS. Started once tritonserver is ready and
# stopped before it, so none of its gRPC streams holds a model while tritonserver shuts down.

def openai_port() -> int | None:
    if os.environ.get("OPENAI_PORT", "").lower() == "off":
        return None
    return env_port("OPENAI_PORT", 9000)


def start_openai(host: str, port: int, grpc: int, repo: Path, admin_key: str) -> subprocess.Popen:
    grpc_host = "127.0.0.1" if host == "0.0.0.0" else host
    args = [sys.executable, "-m", "openai_frontend", "--triton-grpc", f"{grpc_host}:{grpc}", "--host", host,
            "--port", str(port), "--model-repository", str(repo), "--log-level", "warning"]
    # The admin key lets /v1/models read the (restricted) repository index; by environment, not argv.
    env = {**os.environ, "TRITON_ADMIN_KEY": admin_key}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True,
                            preexec_fn=die_with_parent)
    if wait_ready(proc, f"http://{grpc_host}:{port}/health", timeout_s=180):  # after its tokenizer warm-up
        print(f"==> OpenAI-compatible API on http://{grpc_host}:{port}/v1 (pid {proc.pid})\n"
              f"    curl -s http://{grpc_host}:{port}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"      -d '{{\"model\": \"llm\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
              flush=True)
    else:
        print(f"==> the OpenAI-compatible API did not start (exit code {proc.poll()})", file=sys.stderr)
    return proc


def stop_openai(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
# ---- end of the OpenAI-compatible API block ---------------------------------------------------------------


class Supervisor:
    """Runs tritonserver and the OpenAI API, and brings both back when a python-backend stub dies or tritonserver
    exits by itself: Triton 2.51 neither restarts a dead stub nor stops calling the model ready, and no request
    in flight on that stub ever gets an answer (docs/faults.md). A restart ends those requests (their streams
    close), the other models' requests get a CANCELLED final, and the server serves again after a fresh load.
    Its state goes to a small file for the container's probes (scripts/health.py)."""

    def __init__(self, args: list[str], host: str, http: int, grpc: int, metrics: int, exit_timeout: int,
                 repo: Path, admin_key: str, oai_port: int | None):
        self.args, self.host, self.http, self.grpc, self.metrics = args, host, http, grpc, metrics
        self.exit_timeout, self.repo, self.admin_key, self.oai_port = exit_timeout, repo, admin_key, oai_port
        self.local = "127.0.0.1" if host == "0.0.0.0" else host
        self.supervise = os.environ.get("RESTART_ON_STUB_DEATH", "1") != "0"
        self.max_restarts = int(os.environ.get("MAX_RESTARTS_PER_HOUR", "5"))
        self.state_file = state_path(http)
        self.state = ServeState(STARTING, time.time(), os.getpid())
        self.proc: subprocess.Popen | None = None
        self.oai_proc: subprocess.Popen | None = None
        self.restarts: list[float] = []
        self.shm_before = shm_regions()
        self.stub_shm: set[str] = set()
        self.final_code = 0

    def set_state(self, name: str, reason: str | None = None) -> None:
        if name != self.state.state:
            self.state.state, self.state.since = name, time.time()
        if reason is not None:
            self.state.reason = reason
        self.state.server_pid = self.proc.pid if self.proc else None
        write_state(self.state_file, self.state)

    def run(self) -> int:
        """Serve until a signal (exit 0 when stopped cleanly), or until restarting is given up (exit 1)."""
        try:
            while True:
                reason = self.serve_once()
                if self.state.state == STARTING:  # never served: a configuration problem, not for restarts
                    print(f"==> {reason}", file=sys.stderr, flush=True)
                    self.set_state(FAILED, reason)
                    return 1
                self.restarts = [t for t in self.restarts if time.time() - t < 3600] + [time.time()]
                if len(self.restarts) > self.max_restarts:
                    print(f"==> {reason}: {len(self.restarts) - 1} restarts in the last hour already "
                          f"(MAX_RESTARTS_PER_HOUR={self.max_restarts}): giving up", file=sys.stderr, flush=True)
                    self.set_state(FAILED, reason)
                    return 1
                self.state.restarts += 1
                print(f"==> {reason}: restarting tritonserver (restart {self.state.restarts})", file=sys.stderr,
                      flush=True)
                self.set_state(RESTARTING, reason)
                self.stop_all(grace_s=RESTART_GRACE_S)
        except Stop as s:
            print(f"\n==> {s}: shutting down", flush=True)
            return 0
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the leftover check
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if self.state.state != FAILED:
                self.set_state(STOPPING)
            self.final_code = self.stop_all(grace_s=None)
            self.state_file.unlink(missing_ok=True)

    def serve_once(self) -> str:
        """Start tritonserver, serve while it and its stubs live; return why it must be restarted."""
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent)
        self.set_state(STARTING if not self.state.restarts else RESTARTING)
        if not self.wait_ready():
            return f"tritonserver did not become ready (exit code {self.proc.poll()})"
        self.stub_shm |= {argv[STUB_ARG_SHM] for _, argv in our_stubs(self.proc.pid)}
        self.state.dead_stubs = []
        # The OpenAI-compatible API before saying ready: its start-up (imports, tokenizers) takes a core for
        # seconds, which a first burst of requests would otherwise share (16 streams: 5.3 s to a first token
        # instead of 0.5 s).
        if self.oai_port:
            self.oai_proc = start_openai(self.host, self.oai_port, self.grpc, self.repo, self.admin_key)
        self.set_state(SERVING, "")
        if self.state.restarts:
            print(f"==> tritonserver is serving again (restart {self.state.restarts})", flush=True)
        else:
            shown = "localhost" if self.host in ("127.0.0.1", "0.0.0.0") else self.host
            print(banner(shown, self.http, self.grpc, self.metrics, self.admin_key), flush=True)
        watch = StubWatch(self.proc.pid)
        reported: set[int] = set()
        while self.proc.poll() is None:
            time.sleep(0.5)
            for dead in watch.poll():
                if dead.stub.pid in reported:
                    continue
                reported.add(dead.stub.pid)
                self.state.dead_stubs.append({"instance": dead.stub.instance, "model": dead.stub.model,
                                              "pid": dead.stub.pid, "cause": dead.cause, "seen_at": time.time()})
                print(f"==> python-backend stub {dead.stub.instance} (model {dead.stub.model}, pid {dead.stub.pid}) "
                      f"{dead.cause}; Triton 2.51 neither restarts it nor answers its requests", file=sys.stderr,
                      flush=True)
                if self.supervise:
                    return f"stub {dead.stub.instance} {dead.cause}"
            self.set_state(SERVING)
        return f"tritonserver exited by itself (code {self.proc.returncode})"

    def wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if wait_ready(self.proc, f"http://{self.local}:{self.http}/v2/health/ready", timeout_s=1.0):
                return True
            self.set_state(self.state.state)  # heartbeat while the models load
        return False

    def stop_all(self, grace_s: float | None) -> int:
        """The OpenAI API, then tritonserver (SIGKILL after grace_s; None: after its exit timeout + 30 s)."""
        stop_openai(self.oai_proc)  # OpenAI-compatible API, before tritonserver
        self.oai_proc = None
        if self.proc is None:
            return 0
        self.stub_shm |= {argv[STUB_ARG_SHM] for _, argv in our_stubs(self.proc.pid)}
        code = stop(self.proc, self.exit_timeout, self.stub_shm, self.shm_before, grace_s)
        self.proc = None
        return code


def main(argv: list[str]) -> int:
    host = os.environ.get("BIND_ADDRESS", "127.0.0.1")
    http, grpc, metrics = env_port("HTTP_PORT", 8000), env_port("GRPC_PORT", 8001), env_port("METRICS_PORT", 8002)
    exit_timeout = env_port("EXIT_TIMEOUT_SECS", 15)
    repo = Path(os.environ.get("MODEL_REPOSITORY", ROOT / "model_repository")).resolve()
    admin_key = os.environ.get("ADMIN_KEY") or secrets.token_hex(8)
    if not TRITONSERVER.exists():
        raise SystemExit(f"{TRITONSERVER} is missing: run `make setup` first")
    for name, port in (("HTTP_PORT", http), ("GRPC_PORT", grpc), ("METRICS_PORT", metrics)):
        check_free(host, port, name)
    oai_port = openai_port()  # OpenAI-compatible API
    if oai_port:
        check_free(host, oai_port, "OPENAI_PORT")
    args = [str(TRITONSERVER), f"--model-repository={repo}", "--model-control-mode=none",
            f"--http-address={host}", f"--http-port={http}", f"--grpc-address={host}", f"--grpc-port={grpc}",
            f"--metrics-address={host}", f"--metrics-port={metrics}", f"--exit-timeout-secs={exit_timeout}",
            f"--http-restricted-api={RESTRICTED}:admin-key={admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED}:admin-key={admin_key}",
            # Triton keeps up to 8 finished gRPC request states for reuse, each with the capacity of the largest
            # request it ever held: after 2 MiB prompts that stayed resident (75 MB 20 s after a burst, against
            # 55 MB without the pool; perf/results/malloc-tritonserver). One allocation per request is nothing
            # beside a generation. A later --grpc-infer-allocation-pool-size in argv wins.
            "--grpc-infer-allocation-pool-size=0", *argv]
    print("==> " + " ".join(a if "admin-key" not in a else a.split(":admin-key")[0] + ":admin-key=***" for a in args),
          flush=True)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    supervisor = Supervisor(args, host, http, grpc, metrics, exit_timeout, repo, admin_key, oai_port)
    code = supervisor.run()
    return code or supervisor.final_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
