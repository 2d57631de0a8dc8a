"""Probe: where the CPU goes while one stream decodes. CPU milliseconds per output token, by process and thread,
for our served `llm` and (with --peer) llama.cpp's server, beside the wall milliseconds per token.

On a 2-core machine the step's two OpenMP threads share the cores with everything that carries a token to the
client: the stub's sender thread, tritonserver's response and gRPC threads, and the client itself. The engine's
step alone (perf.probes.step_timing) is faster than a served token; this says which process takes the difference.
Each thread's run time comes from /proc/<pid>/task/<tid>/schedstat (nanoseconds), read before and after the
streams; the client's from this process's own CPU time.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.probes.stream_cpu --quant q8_0
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.probes.stream_cpu --quant q8_0 --peer --json F

--peer needs llama.cpp built into .cache/ (perf/peers/llamacpp.py; about 10 minutes the first time).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from perf.ab import workloads as ab_workloads
from perf.peers import cpu_peer

from server_harness.host import cpu_model_name


@dataclass(frozen=True)
class ThreadKey:
    pid: int
    tid: int
    process: str  # what the process is: tritonserver, stub:<model>, llama-server, or its command's name
    thread: str  # the thread's comm


def children_map(proc: str = "/proc") -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process we can read."""
    out: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir(proc)):
        try:
            with open(f"{proc}/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry))
    return out


def descendants(root: int, proc: str = "/proc") -> list[int]:
    kids = children_map(proc)
    found, todo = [], list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(kids.get(pid, []))
    return sorted(found)


def process_role(pid: int, proc: str = "/proc") -> str:
    """A short name for what the process does, from its command line."""
    with open(f"{proc}/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if not argv:
        return "?"
    name = Path(argv[0]).name
    if name == "triton_python_backend_stub" and argv[1:]:
        return "stub:" + Path(argv[1]).parent.parent.name  # .../<model>/1/model.py
    return name


def thread_run_ns(pid: int, proc: str = "/proc") -> dict[ThreadKey, int]:
    """Run time so far of each thread of pid (ns). Threads that end between reads lose their time: the probe
    reads while servers are warm, whose threads live for the whole run."""
    out = {}
    try:
        role = process_role(pid, proc)
        tids = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"{proc}/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[ThreadKey(pid, int(tid), role, comm)] = ns
    return out


def snapshot(root: int, proc: str = "/proc") -> dict[ThreadKey, int]:
    out: dict[ThreadKey, int] = {}
    for pid in descendants(root, proc):
        out |= thread_run_ns(pid, proc)
    return out


def per_token(before: dict[ThreadKey, int], after: dict[ThreadKey, int], tokens: int,
              top_threads: int = 6) -> dict:
    """CPU ms per token by process role, and the busiest threads."""
    deltas = {k: after[k] - before.get(k, 0) for k in after}
    by_role: dict[str, float] = {}
    for k, ns in deltas.items():
        by_role[k.process] = by_role.get(k.process, 0.0) + ns
    busiest = sorted(deltas.items(), key=lambda kv: -kv[1])[:top_threads]
    return {"processes_ms_per_token": {role: round(ns / 1e6 / tokens, 3) for role, ns in
                                       sorted(by_role.items(), key=lambda kv: -kv[1]) if ns > 0},
            "busiest_threads_ms_per_token": [{"process": k.process, "thread": k.thread, "tid": k.tid,
                                              "ms": round(ns / 1e6 / tokens, 3)} for k, ns in busiest if ns > 0]}


def measure(client, prompts: list[str], tokens: int) -> dict:
    """One stream at a time over the prompts; wall and CPU per decoded token (first token to last)."""
    walls, decoded, cpu_ns = [], 0, 0
    before = snapshot(os.getpid())
    for prompt in prompts:
        c0 = time.process_time_ns()
        r = client.stream(prompt, tokens)
        cpu_ns += time.process_time_ns() - c0
        n = r.num_tokens - 1
        walls.append(1000 * (r.last_s - r.first_s) / n)
        decoded += r.num_tokens
    after = snapshot(os.getpid())
    figures = per_token(before, after, decoded)
    figures["processes_ms_per_token"]["client (this process)"] = round(cpu_ns / 1e6 / decoded, 3)
    total = sum(figures["processes_ms_per_token"].values())
    wall = statistics.median(walls)
    return {"wall_ms_per_token": round(wall, 2), "wall_ms_per_token_runs": [round(w, 2) for w in walls],
            "cpu_ms_per_token": round(total, 3), "cores_busy": round(total / wall, 2), **figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(cpu_peer.MODEL))
    ap.add_argument("--quant", choices=("none", "q8_0", "q4_1"), default="q8_0", help="as perf.peers.cpu_peer")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="streams per side, one at a time")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--peer", action="store_true", help="llama.cpp's server too")
    ap.add_argument("--work", default=str(cpu_peer.ROOT / ".cache" / "stream-cpu"))
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    # What cpu_peer's serve_* read from its own arguments.
    args.ours_model, args.ours_quantization, args.peer_gguf = args.model, "none", None
    args.speculative_method, args.concurrency = "off", 1
    if args.quant == "q8_0":
        args.ours_quantization = "int8"
    elif args.quant == "q4_1":
        args.ours_model = args.peer_gguf = str(cpu_peer.SMOL_Q4_1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [r.prompt for r in ab_workloads.build("mixed", tokenizer, 0.25, args.repeats + 1).requests]
    result: dict = {"quant": args.quant, "tokens": args.tokens, "repeats": args.repeats, "cpu": cpu_model_name()}
    serves = [("ours", cpu_peer.serve_ours)] + ([("llama_cpp", cpu_peer.serve_llama_cpp)] if args.peer else [])
    for name, serve in serves:  # one side up at a time: the other's idle threads stay out of the figures
        with contextlib.ExitStack() as stack:
            client, _ = stack.enter_context(serve(args))
            client.stream(prompts[-1], 8)  # warm-up: first calls pay lazy initialisation
            result[name] = measure(client, prompts[:args.repeats], args.tokens)
        print(f"[stream_cpu] {name}: {json.dumps(result[name], indent=1)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
