"""What scripts/serve.py tells the container's probes (scripts/health.py), and what the probes conclude.

Triton 2.51 keeps answering /v2/health/ready and /v2/health/live with 200 after a model's stub died (docs/faults.md),
so the probes cannot ask Triton alone. serve.py writes its state to one small JSON file per HTTP port (atomically,
with a heartbeat every loop): starting, serving, restarting (a stub died or tritonserver exited, and serve.py is
bringing it back), stopping, failed (it gave up). The probes read it, look for dead stubs themselves, and ask
Triton. The decisions are pure functions here, tested without a server. Standard library only.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STARTING, SERVING, RESTARTING, STOPPING, FAILED = "starting", "serving", "restarting", "stopping", "failed"
HEARTBEAT_STALE_S = 30.0  # serve.py writes every loop (0.5 s); this long without a write, it is stuck or gone


@dataclass
class ServeState:
    state: str
    since: float  # time.time() when this state began
    serve_pid: int
    server_pid: int | None = None
    heartbeat: float = 0.0
    restarts: int = 0
    reason: str = ""  # why the last restart happened
    dead_stubs: list[dict] = field(default_factory=list)  # {"instance", "model", "pid", "cause", "seen_at"}


def state_path(http_port: int | str) -> Path:
    """One file per HTTP port, so two servers on one host (make serve twice) keep apart."""
    return Path(os.environ.get("SERVE_STATE_DIR", tempfile.gettempdir())) / f"llm-serve-{http_port}.json"


def write_state(path: Path, state: ServeState) -> None:
    state.heartbeat = time.time()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state)))
    os.replace(tmp, path)  # a probe never reads half a file


def read_state(path: Path) -> ServeState | None:
    try:
        return ServeState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str


def readiness(state: ServeState | None, now: float, triton_ready: bool, dead_stubs: list[str]) -> Verdict:
    """Send traffic here? Only while serve.py serves, Triton says ready and no stub of the server is dead."""
    if state is None:
        return Verdict(False, "no state from serve.py")
    if now - state.heartbeat > HEARTBEAT_STALE_S:
        return Verdict(False, f"serve.py silent for {now - state.heartbeat:.0f} s")
    if state.state != SERVING:
        return Verdict(False, f"serve.py is {state.state}" + (f" ({state.reason})" if state.reason else ""))
    if dead_stubs:
        return Verdict(False, "dead stub: " + "; ".join(dead_stubs))
    if not triton_ready:
        return Verdict(False, "tritonserver is not ready")
    return Verdict(True, "ready")


def liveness(state: ServeState | None, now: float, triton_live: bool, dead_stub_grace_s: float,
             start_budget_s: float) -> Verdict:
    """Will this container come back by itself? No once serve.py is stuck or gave up, a restart or start takes
    longer than start_budget_s, or a dead stub has been left alone for dead_stub_grace_s (serve.py restarts the
    server at once unless RESTART_ON_STUB_DEATH=0; then the orchestrator must restart the container)."""
    if state is None:
        return Verdict(False, "no state from serve.py")
    if now - state.heartbeat > HEARTBEAT_STALE_S:
        return Verdict(False, f"serve.py silent for {now - state.heartbeat:.0f} s")
    if state.state == FAILED:
        return Verdict(False, f"serve.py gave up: {state.reason}")
    if state.state in (STARTING, RESTARTING) and now - state.since > start_budget_s:
        return Verdict(False, f"{state.state} for {now - state.since:.0f} s (budget {start_budget_s:.0f} s)")
    if state.state == SERVING:
        stale = [d for d in state.dead_stubs if now - d["seen_at"] > dead_stub_grace_s]
        if stale:
            d = stale[0]
            return Verdict(False, f"stub {d['instance']} dead for {now - d['seen_at']:.0f} s ({d['cause']}) and "
                                  "nothing restarts it")
        if not triton_live:
            return Verdict(False, "tritonserver does not answer /v2/health/live")
    return Verdict(True, state.state)
