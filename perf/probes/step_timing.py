"""Probe: which OpenMP and torch settings make a bare decode step fastest? (docs/cpu.md's thread settings)

Median wall ms of a bare decode step at one batch size: the quickest way to compare OpenMP and torch
settings, which must be chosen in the environment before torch loads (so: one process per setting).

    .venv/bin/python -m perf.probes.step_timing --batch 1
    OMP_WAIT_POLICY=ACTIVE .venv/bin/python -m perf.probes.step_timing --batch 16
    OMP_NUM_THREADS=1 .venv/bin/python -m perf.probes.step_timing --batch 1

Runs --batch requests (32-token prompts) into decode, then --rounds rounds of --steps steps; prints the
median ms/step and every round's, with the threads and the OpenMP settings it ran under.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch

from perf.probes.cpu_profile import decode_steps
from inflight import LLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, num_kv_blocks=64 * args.batch + 64, block_size=16,
              speculative_method="off")  # plain decode steps of the batch
    engine = decode_steps(llm, args.batch, prompt_len=32, warmup=5)
    rounds = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        rounds.append(1000 * (time.perf_counter() - t) / args.steps)
    settings = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "INFLIGHT_CPU_COMPILE")
                if k in os.environ}
    print(f"batch {args.batch}, {torch.get_num_threads()} threads, {settings}: "
          f"median {statistics.median(rounds):.1f} ms/step, rounds {[round(r, 1) for r in rounds]}, "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
