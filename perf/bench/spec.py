"""Speculative decoding on this CPU, served: what drafts win on text nobody here wrote, and what they cost where
they cannot help.

One tritonserver serves SmolLM2-135M-Instruct twice: `llm` as configured by default (speculative_method auto:
n-gram drafts on CPU, the cost-weighing draft policy) and `llm_off` (speculative_method off). The tasks
(perf/bench/spec_tasks.py), each with a check that it was done:

- grounded: quote, extract, rename, add a docstring, correct a spelling, summarize, over Python's own standard
  library and its LICENSE.txt (picked with a seed), greedy, ending at EOS or max_tokens;
- copy-heavy: the generated template files of the benchmark's first version (one labelled row);
- open-ended: two stories asked for with no source text, greedy and at temperature 1 (seeded): the control.

Single stream: every task one request at a time on each side, sides alternating (on, off; the next round off,
on), --rounds rounds. Decode time per output token = (last token - first token) / (tokens - 1), so the prompt's
prefill is not in it; per group and round the sum over its tasks, and each figure is the median over rounds of
the ratio within a round (off ms/token over on ms/token: above 1 drafts are faster). Acceptance, and how many
draft tokens the policy spent per output token, come from `llm`'s own /metrics around each task. The checks read
the `on` side's output of the last round; `identical` says whether both sides wrote the same text every round.

c16: the A/B "mixed" workload (perf.ab.workloads, ignore_eos) from 16 closed-loop streaming clients on each side
in turn, the order alternating by round; the ratio of their total output tokens/s.

--busy-rounds: the single streams again while a busy loop (started and killed here) holds the last CPU this
process may use: what the draft policy does when the cores, and so verification rows, get dearer.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.bench.spec --json perf/results/spec/spec.json

--json writes open_ended_ratio (the worse of the greedy and the temperature-1 control), single_speedup (the
grounded tasks), c16_ratio and acceptance_rate at the top level, with everything measured below them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer

from perf.ab import workloads as ab_workloads
from perf.bench import spec_tasks
from perf.peers import cpu_peer
from perf.peers.stream_clients import Result, TritonStream
from server_harness.host import cpu_model_name, cpuinfo_field
from server_harness.quiescence import scrape
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.stream_client import make_inputs

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
SIDES = ("on", "off")
METRICS_INTERVAL_MS = 200  # how often the models publish /metrics here: a task's counters are read 0.5 s after it
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
# The groups the figures are computed over, by task kind (and temperature for the control).
GROUPS = {"grounded": lambda t: t.kind == spec_tasks.GROUNDED,
          "copy-heavy": lambda t: t.kind == spec_tasks.COPY_HEAVY,
          "open-ended greedy": lambda t: t.kind == spec_tasks.OPEN_ENDED and t.temperature == 0,
          "open-ended t1": lambda t: t.kind == spec_tasks.OPEN_ENDED and t.temperature > 0}


@dataclass
class TextResult(Result):
    text: str = ""


class TextStream(TritonStream):
    """One model over gRPC streaming, keeping the text and taking a temperature and seed; one connection and
    stream per calling thread (the c16 clients share it)."""

    def __init__(self, url: str, model: str):
        super().__init__(url, model)
        self.name = model

    def stream(self, prompt: str, max_tokens: int, ignore_eos: bool = True, temperature: float = 0.0,
               seed: int | None = None) -> TextResult:
        client, inbox = self._conn()
        values = {"max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos, "temperature": temperature,
                  "return_num_output_tokens": True}
        if seed is not None:
            values["seed"] = seed
        res = TextResult(time.perf_counter())
        chunks: list[bytes] = []
        client.async_stream_infer(self.name, make_inputs(prompt, values), request_id=str(next(self._ids)))
        while True:
            t, result, error = inbox.get(timeout=600)
            if error is not None:
                raise RuntimeError(f"{self.name}: {error}")
            counts = result.as_numpy("num_output_tokens")
            text = result.as_numpy("text_output")
            if text is not None:
                chunks.extend(bytes(x) for x in text.reshape(-1))
            res.arrivals.append((t, int(counts.sum()) if counts is not None else 0))
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                res.text = b"".join(chunks).decode("utf-8", errors="replace")
                return res

def decode_time(result: Result) -> tuple[float, int]:
    """(seconds from the first token to the last, tokens after the first): the prompt's prefill is not in it."""
    first_tokens = next(n for _, n in result.arrivals if n)
    return result.last_s - result.first_s, result.num_tokens - first_tokens


def spec_counts(server: TritonServer) -> dict[str, float]:
    """`llm`'s draft counters once the exporter has published the latest counts."""
    time.sleep(2.5 * METRICS_INTERVAL_MS / 1000)
    samples = scrape(server.metrics_url, "llm")
    return {k.split(":")[1].removesuffix("_total"): samples.get(k, 0) for k in SPEC_COUNTERS}


def single_streams(server: TritonServer, clients: dict, tasks: list[spec_tasks.Task], rounds: int,
                   label: str) -> dict:
    """Every task on each side in turn, the order alternating by round. Per task and side: per-round (seconds,
    tokens) and the texts; per task the draft counters of its `on` requests."""
    runs = {t.name: {side: [] for side in SIDES} for t in tasks}
    texts = {t.name: {side: [] for side in SIDES} for t in tasks}
    drafts = {t.name: dict.fromkeys(("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                     "spec_decode_num_accepted_tokens"), 0.0) for t in tasks}
    counts = spec_counts(server)
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for task in tasks:
            for side in order:
                res = clients[side].stream(task.prompt, task.max_tokens, ignore_eos=False,
                                           temperature=task.temperature, seed=task.seed)
                runs[task.name][side].append(decode_time(res))
                texts[task.name][side].append(res.text)
            after = spec_counts(server)  # only `on` drafts: the delta is this task's
            for k in drafts[task.name]:
                drafts[task.name][k] += after[k] - counts[k]
            counts = after
        for group, members in GROUPS.items():
            chosen = [t for t in tasks if members(t)]
            if chosen:
                ms = {side: _ms_per_token([runs[t.name][side][r] for t in chosen]) for side in SIDES}
                print(f"[spec] {label} round {r}: {group}: on {ms['on']:.2f} off {ms['off']:.2f} ms/token "
                      f"(x{ms['off'] / ms['on']:.3f})", flush=True)
    return {"runs": runs, "texts": texts, "drafts": drafts}


def _ms_per_token(pairs: list[tuple[float, int]]) -> float:
    return 1000 * sum(s for s, _ in pairs) / max(sum(n for _, n in pairs), 1)


def acceptance(counts: dict[str, float], output_tokens: int) -> dict:
    drafts, drafted, accepted = (counts["spec_decode_num_drafts"], counts["spec_decode_num_draft_tokens"],
                                 counts["spec_decode_num_accepted_tokens"])
    return {"drafts": int(drafts), "draft_tokens": int(drafted), "accepted_tokens": int(accepted),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "draft_tokens_per_output_token": round(drafted / output_tokens, 3) if output_tokens else 0.0}


def summarize(measured: dict, tasks: list[spec_tasks.Task], rounds: int) -> dict:
    """Per task and per group: ms/token on and off (medians over rounds), the ratio (median of the per-round
    ratios), acceptance, and per task the check of the last round's `on` output."""
    runs, texts, drafts = measured["runs"], measured["texts"], measured["drafts"]
    per_task = {}
    for t in tasks:
        on, off = runs[t.name]["on"], runs[t.name]["off"]
        check = t.check(texts[t.name]["on"][-1])
        per_task[t.name] = {
            "kind": t.kind, "temperature": t.temperature, "source": t.source,
            "ms_per_token_on": round(statistics.median(_ms_per_token([x]) for x in on), 2),
            "ms_per_token_off": round(statistics.median(_ms_per_token([x]) for x in off), 2),
            "speedup": round(statistics.median(_ms_per_token([b]) / _ms_per_token([a]) for a, b in zip(on, off)), 3),
            "tokens": on[-1][1] + 1,
            **acceptance(drafts[t.name], sum(n for _, n in on)),
            "check": {"passed": check.passed, "score": round(check.score, 3), "what": check.what},
            "identical_on_off": texts[t.name]["on"] == texts[t.name]["off"],
        }
    groups = {}
    for group, members in GROUPS.items():
        chosen = [t for t in tasks if members(t)]
        if not chosen:
            continue
        ms = {side: [_ms_per_token([runs[t.name][side][r] for t in chosen]) for r in range(rounds)] for side in SIDES}
        counts = {k: sum(drafts[t.name][k] for t in chosen) for k in drafts[chosen[0].name]}
        groups[group] = {
            "tasks": [t.name for t in chosen],
            "ms_per_token_on": round(statistics.median(ms["on"]), 2),
            "ms_per_token_off": round(statistics.median(ms["off"]), 2),
            "ratio": round(statistics.median(b / a for a, b in zip(ms["on"], ms["off"])), 3),
            "ratio_rounds": [round(b / a, 3) for a, b in zip(ms["on"], ms["off"])],
            **acceptance(counts, sum(runs[t.name]["on"][r][1] for t in chosen for r in range(rounds))),
            "checks_passed": sum(per_task[t.name]["check"]["passed"] for t in chosen),
        }
    return {"groups": groups, "tasks": per_task}


def headline(summary: dict) -> dict:
    groups = summary["groups"]
    open_ended = {g: groups[g]["ratio"] for g in ("open-ended greedy", "open-ended t1") if g in groups}
    return {"open_ended_ratio": min(open_ended.values()) if open_ended else None,
            "open_ended_ratio_greedy": open_ended.get("open-ended greedy"),
            "open_ended_ratio_t1": open_ended.get("open-ended t1"),
            "single_speedup": groups.get("grounded", {}).get("ratio"),
            "copy_heavy_speedup": groups.get("copy-heavy", {}).get("ratio"),
            "acceptance_rate": groups.get("grounded", {}).get("acceptance_rate")}


@contextlib.contextmanager
def busy_core():
    """A Python busy loop pinned to the last CPU this process may use, for as long as the block runs."""
    core = max(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield core
    finally:
        loop.kill()
        loop.wait()


def c16(clients: dict, workload, warm_up, rounds: int, concurrency: int) -> dict:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            figures = cpu_peer.load_test(clients[side], workload, warm_up, concurrency)
            runs[side].append(figures)
            print(f"[spec] c{concurrency} round {r}: {side} {figures['output_tok_s']} tokens/s", flush=True)
    out: dict = {}
    for side, figures in runs.items():
        tokens = sum(f["output_tokens"] for f in figures)
        seconds = sum(f["seconds"] for f in figures)
        out[side] = {"output_tok_s": round(tokens / seconds, 1), "runs": figures}
    out["ratio"] = round(out["on"]["output_tok_s"] / out["off"]["output_tok_s"], 3)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="single-stream rounds over the tasks, quiet")
    ap.add_argument("--busy-rounds", type=int, default=2, help="single-stream rounds with a core busy (0: none)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="picks the grounded tasks' texts and the t1 seeds")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"task groups to run, of {', '.join(GROUPS)}")
    ap.add_argument("--c16-rounds", type=int, default=2, help="c16 runs per side (0: none)")
    ap.add_argument("--requests", type=int, default=96, help="mixed-load requests per c16 run")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.25, help="scales the mixed workload's 20/50/200/800 outputs")
    ap.add_argument("--draft-policy", default=None, choices=("cost", "always"),
                    help="speculative_draft_policy of `llm` (default: the engine's)")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "spec-bench"), help="server logs go here")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    unknown = set(args.groups.split(",")) - set(GROUPS)
    if unknown:
        ap.error(f"--groups {args.groups!r}: {', '.join(sorted(unknown))} unknown; allowed {', '.join(GROUPS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = Path(args.work).resolve()  # tritonserver reads the repository from its own working directory
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    wanted = args.groups.split(",")
    tasks = [t for t in spec_tasks.all_tasks(tokenizer, args.seed, args.max_tokens)
             if any(GROUPS[g](t) for g in wanted)]
    on_params = {"model": str(MODEL), "metrics_interval_ms": METRICS_INTERVAL_MS}
    if args.draft_policy:
        on_params["speculative_draft_policy"] = args.draft_policy
    repo = make_model_repository(ROOT / "model_repository", work / "model_repository", {
        "llm": on_params, "llm_off": {"model": str(MODEL), "speculative_method": "off",
                                      "metrics_interval_ms": METRICS_INTERVAL_MS}})
    env = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    result: dict = {
        "cpu": cpu_model_name(), "cpu_family_model": f"{cpuinfo_field('cpu family')}/{cpuinfo_field('model')}",
        "cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0], "stdlib": str(spec_tasks.STDLIB),
        "load_average_before": [round(x, 2) for x in os.getloadavg()], "max_tokens": args.max_tokens,
        "seed": args.seed, "rounds": args.rounds, "draft_policy": args.draft_policy or "engine default"}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(TritonServer(repo, log_path=work / "tritonserver.log", startup_timeout_s=900,
                                                  env=env))
        clients = {"on": TextStream(server.grpc_url, "llm"), "off": TextStream(server.grpc_url, "llm_off")}
        for client in clients.values():
            stack.callback(client.close)
            client.stream(tasks[0].prompt, 8, ignore_eos=False)  # warm: first calls pay for lazy set-up
        quiet = summarize(single_streams(server, clients, tasks, args.rounds, "quiet"), tasks, args.rounds)
        result.update(headline(quiet))
        result["quiet"] = quiet
        if args.c16_rounds:
            workload = ab_workloads.build("mixed", tokenizer, args.scale, args.requests)
            warm_up = ab_workloads.build("mixed", tokenizer, args.scale, args.concurrency, seed=1)
            result["c16"] = c16(clients, workload, warm_up, args.c16_rounds, args.concurrency)
            result["c16_ratio"] = result["c16"]["ratio"]
        if args.busy_rounds:
            with busy_core() as core:
                result["busy_core"] = core
                busy = summarize(single_streams(server, clients, tasks, args.busy_rounds, f"cpu {core} busy"),
                                 tasks, args.busy_rounds)
            result["busy"] = {**headline(busy), **busy}
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    top = {k: result.get(k) for k in ("open_ended_ratio", "single_speedup", "c16_ratio", "acceptance_rate",
                                      "open_ended_ratio_greedy", "open_ended_ratio_t1", "copy_heavy_speedup")}
    if "busy" in result:
        top["busy"] = {k: result["busy"][k] for k in ("open_ended_ratio", "single_speedup", "acceptance_rate")}
    top["tasks"] = {name: {k: row[k] for k in ("ms_per_token_on", "ms_per_token_off", "speedup", "acceptance_rate",
                                               "draft_tokens_per_output_token", "identical_on_off")}
                    | {"check": row["check"]["passed"]} for name, row in quiet["tasks"].items()}
    print(json.dumps(top, indent=2))
    result = top | result
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
