#!/usr/bin/env python3
"""The container's probes: `health.py ready` and `health.py live` exit 0 when the answer is yes, 1 when no
(the reason on stdout). The image's HEALTHCHECK and the Kubernetes exec probes (docker/k8s) run them.

Triton 2.51 alone cannot answer either question after a model's python-backend stub died: it still says
ready and live, the dead stub stays a zombie, and no request on it ever gets an answer (docs/faults.md). So:
  ready  serve.py serves (its state file, server_harness.serve_state), no stub of the server is a zombie, and
         /v2/health/ready answers 200;
  live   serve.py's heartbeat is fresh, it has not given up, a start or restart stays within START_BUDGET_S
         (default 600), no dead stub is left alone longer than DEAD_STUB_GRACE_S (default 30), and while
         serving, /v2/health/live answers 200.
HTTP_PORT (default 8000) names the server, as for serve.py. Standard library and server_harness only.
"""
from __future__ import annotations

import os
import sys
import time

from server_harness.quiescence import http_status
from server_harness.serve_state import liveness, read_state, readiness, state_path
from server_harness.stub_watch import zombie_stubs


def answers_200(url: str) -> bool:
    return http_status(url, timeout_s=3.0) == 200  # two asks fit the probes' 5 s


def main(argv: list[str]) -> int:
    if argv not in (["ready"], ["live"]):
        print("usage: health.py ready|live", file=sys.stderr)
        return 2
    port = os.environ.get("HTTP_PORT", "8000")
    base = f"http://127.0.0.1:{port}/v2/health"
    state = read_state(state_path(port))
    now = time.time()
    if argv == ["ready"]:
        dead = zombie_stubs(state.server_pid) if state and state.server_pid else []
        verdict = readiness(state, now, answers_200(f"{base}/ready"), dead)
    else:
        verdict = liveness(state, now, answers_200(f"{base}/live"),
                           float(os.environ.get("DEAD_STUB_GRACE_S", "30")),
                           float(os.environ.get("START_BUDGET_S", "600")))
    print(verdict.why)
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
