"""Probe: what large prompts cost tritonserver's memory, and whether it comes back after them.

One container of the CPU image, one instance per engine. Phases of refused requests to `llm`, tritonserver's
RSS (and its private part, RssAnon) read from /proc after each: small bad requests (every kind the soak sends but
the 2 MiB prompt), then 2 MiB prompts one at a time, then six at a time, then 20 seconds idle. The last line says
whether the memory the burst took was given back. Found by the soak bisection (perf/results/malloc-tritonserver):
of every request path the image soak drives, only the 2 MiB prompt raised tritonserver's RSS.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.probes.large_prompts --image llm-triton:cpu
    ... --env MALLOC_CONF=dirty_decay_ms:10000   (any allocator setting, to compare)
    ... --host --triton-arg=--grpc-infer-allocation-pool-size=0   (tritonserver on the host, tiny-llama)
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from perf.soak.run import key_value
from perf.soak.traffic import BAD

from server_harness.container import ImageServer, repository_with
from server_harness.host import status_mb
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.stream_client import StreamClient

ROOT = Path(__file__).resolve().parents[2]
LARGE = "oversize_prompt"


def refused_requests(grpc_url: str, kinds: list[str], count: int, clients: int, tag: str) -> int:
    """`count` bad requests of `kinds` from `clients` streams, each awaited; returns how many were refused."""
    refused = [0] * clients

    def client(c: int) -> None:
        stream = StreamClient(grpc_url)
        try:
            for i in range(count // clients):
                prompt, values, params = BAD[kinds[i % len(kinds)]]
                rid = f"{tag}-{c}-{i}"
                stream.send("llm", rid, prompt, values, params)
                if stream.wait_finals(60, ids=[rid]) and stream.records[rid].error:
                    refused[c] += 1
        finally:
            stream.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(refused)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.probes.large_prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", default="llm-triton:cpu")
    p.add_argument("--env", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="set in the server's environment; repeatable")
    p.add_argument("--host", action="store_true", help="tritonserver on the host (tiny-llama) instead of the image")
    p.add_argument("--triton-arg", action="append", default=[], help="passed to tritonserver (--host); repeatable")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    env = dict(args.env)
    small = [k for k in BAD if k != LARGE]
    with tempfile.TemporaryDirectory(prefix="large-prompts-") as tmp:
        if args.host:
            repo = make_model_repository(ROOT / "model_repository", Path(tmp) / "repo",
                                         {"llm": {"model": ROOT / "models" / "tiny-llama"}})
            server = TritonServer(repo, args.triton_arg, env=env).start()
        else:
            repo = repository_with(ROOT / "model_repository", Path(tmp) / "repo", 1, {})
            server = ImageServer(args.image, repository=repo, env=env).start()
        try:
            pid = server.pid if args.host else server.processes()["tritonserver"]

            def report(what: str) -> None:
                rss, anon = status_mb(pid, "VmRSS"), status_mb(pid, "RssAnon")
                print(f"{what:<36} tritonserver RSS {rss:>4.0f} MB, private {anon:>4.0f} MB", flush=True)

            report("ready")
            phases = [("small bad requests x3000, 6 clients", small, 3000, 6),
                      ("2 MiB prompts x100, 1 client", [LARGE], 100, 1),
                      ("2 MiB prompts x300, 6 clients", [LARGE], 300, 6)]
            for what, kinds, count, clients in phases:
                for r in range(args.rounds):
                    refused = refused_requests(server.grpc_url, kinds, count, clients, f"{r}-{what[:5]}")
                    if refused != count // clients * clients:
                        print(f"  only {refused} of {count} refused")
                    report(f"{what} ({r + 1})")
            time.sleep(20)
            report("idle 20 s")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
