"""The engine's own throughput at 1 and 2 threads on perf.peers.cpu_peer's workload, with no server in the way.

    .venv/bin/python -m perf.bench.engine_scaling --json perf/results/cpu-peer/few-row-blas/engine-scaling.json

The same requests as perf/peers/cpu_peer.py (the A/B mixed workload: 96 requests, 32-token prompts, outputs
5/12/50/200, greedy, ignore_eos) go through LLM.generate with max_num_seqs = --concurrency, which admits a
new request as soon as one finishes: the engine side of 16 closed-loop clients. Each thread count runs in its
own process (OpenMP reads its settings when torch loads), after a warm-up of --concurrency requests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(args) -> dict:
    import inflight  # noqa: F401, I001 - first: the OpenMP settings, as served
    import torch

    from perf.ab import workloads as ab_workloads
    from inflight import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=args.concurrency)
    workload = ab_workloads.build("mixed", llm.tokenizer, args.scale, args.requests)
    warm_up = ab_workloads.build("mixed", llm.tokenizer, args.scale, args.concurrency, seed=1)

    def run(requests) -> tuple[int, float]:
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
        t = time.perf_counter()
        outs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    run(warm_up.requests)
    tokens, seconds = run(workload.requests)
    return {"threads": torch.get_num_threads(), "output_tokens": tokens, "seconds": round(seconds, 2),
            "output_tok_s": round(tokens / seconds, 1), "load_avg": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.25, help="scales the 20/50/200/800 output mix")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = {}
    for n in args.threads.split(","):
        cmd = [sys.executable, "-m", "perf.bench.engine_scaling", "--child", "--model", args.model,
               "--requests", str(args.requests), "--concurrency", str(args.concurrency), "--scale", str(args.scale)]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": n}, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"the {n}-thread run failed:\n{done.stderr[-2000:]}")
        runs[n] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{n} thread(s): {runs[n]['output_tok_s']} output tok/s ({runs[n]['output_tokens']} tokens in "
              f"{runs[n]['seconds']} s, load {runs[n]['load_avg']:.2f})", flush=True)
    result = {"runs": runs}
    if "1" in runs and len(runs) > 1:
        top = max(runs, key=int)
        result["scaling"] = round(runs[top]["output_tok_s"] / runs["1"]["output_tok_s"], 2)
        print(f"{top} threads over 1: {result['scaling']}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
