"""What the OpenAI frontend hop costs: the same streaming requests at concurrency C, sent directly to
tritonserver over gRPC and through the frontend over HTTP/SSE; prints one Markdown row of added TTFT and
added latency per output token.

    .venv/bin/python -m perf.bench.openai_overhead                     # starts its own stack (tiny-llama)
    .venv/bin/python -m perf.bench.openai_overhead --model-dir models/SmolLM2-135M-Instruct
    .venv/bin/python -m perf.bench.openai_overhead --triton-grpc 127.0.0.1:8001 --openai-url http://127.0.0.1:9000 \\
        --model llm

Loopback only, bounded: --requests per arm and round, --rounds, and a --max-seconds deadline after which
no new request starts. The arms alternate (direct, frontend, direct, ...) so drift in machine load hits
both; each request uses greedy decoding with ignore_eos, so both arms generate the same tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from server_harness.openai_stack import FrontendProcess
from server_harness.repository import make_model_repository
from server_harness.server import TritonServer
from server_harness.stream_client import make_inputs

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Sample:
    ttft_s: float  # request sent -> first non-empty text
    per_token_s: float  # (last text - first text) / (output tokens - 1)
    num_tokens: int


def _require_loopback(host: str) -> None:
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise SystemExit(f"{host} is not a loopback address: this benchmark only targets this machine")


def _sample(t0: float, first: float | None, last: float | None, num_tokens: int) -> Sample:
    if first is None or num_tokens < 2:
        raise RuntimeError(f"request produced {num_tokens} tokens; need at least 2")
    return Sample(first - t0, (last - first) / (num_tokens - 1), num_tokens)


async def direct_one(client, model: str, prompt: str, max_tokens: int) -> Sample:
    inputs = make_inputs(prompt, {"stream": True, "max_tokens": max_tokens, "temperature": 0.0,
                                   "ignore_eos": True, "return_finish_reason": True,
                                   "return_num_output_tokens": True})

    async def requests():
        yield {"model_name": model, "inputs": inputs}

    t0 = time.perf_counter()
    first = last = None
    num_tokens = 0
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise RuntimeError(error.message())
        now = time.perf_counter()
        if result.as_numpy("text_output").reshape(-1)[0]:
            first = first or now
            last = now
        num_tokens += int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        # Every response carries finish_reason ("None" until the last). Read on to the end of the stream
        # rather than break at the final: cancelling a finished stream holds the model up at shutdown.
    return _sample(t0, first, last, num_tokens)


async def frontend_one(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    num_tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or now
                last = now
    return _sample(t0, first, last, num_tokens)


async def run_arm(one, n: int, concurrency: int, deadline: float, prompts: list[str]) -> list[Sample]:
    queue = list(range(n))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            i = queue.pop()
            samples.append(await one(prompts[i % len(prompts)]))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


async def measure(args, grpc_url: str, openai_url: str) -> dict[str, list[Sample]]:
    from tritonclient.grpc.aio import InferenceServerClient

    # Distinct prompts of equal length, so the prefix cache helps neither arm more than the other.
    prompts = [f"Request {i:03d}: tell me a long story about the sea and the ships that sail on it."
               for i in range(args.requests)]
    deadline = time.monotonic() + args.max_seconds
    results: dict[str, list[Sample]] = {"direct": [], "frontend": []}
    grpc_client = InferenceServerClient(grpc_url)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=openai_url, timeout=120, limits=limits) as http:
        arms = {"direct": lambda p: direct_one(grpc_client, args.model, p, args.max_tokens),
                "frontend": lambda p: frontend_one(http, args.model, p, args.max_tokens)}
        # Warm-up: connections, the frontend's model-config cache, the engine's first steps.
        for one in arms.values():
            await run_arm(one, args.concurrency, args.concurrency, deadline, prompts)
        for _ in range(args.rounds):
            for name, one in arms.items():
                results[name] += await run_arm(one, args.requests, args.concurrency, deadline, prompts)
    await grpc_client.close()
    return results


def _ms(v: float) -> str:
    return f"{v * 1000:.1f}"


def report(args, results: dict[str, list[Sample]]) -> str:
    d, f = results["direct"], results["frontend"]
    if not d or not f:
        raise SystemExit("no samples: raise --max-seconds")

    def med(samples, attr):
        return statistics.median(getattr(s, attr) for s in samples)

    ttft_d, ttft_f = med(d, "ttft_s"), med(f, "ttft_s")
    tok_d, tok_f = med(d, "per_token_s"), med(f, "per_token_s")
    header = ("| model | concurrency | requests (direct/frontend) | out tokens | TTFT p50 direct ms | "
              "TTFT p50 frontend ms | added TTFT ms | per-token p50 direct ms | per-token p50 frontend ms | "
              "added per token ms |\n|---|---|---|---|---|---|---|---|---|---|")
    row = (f"| {args.model_label} | {args.concurrency} | {len(d)}/{len(f)} | {args.max_tokens} | {_ms(ttft_d)} | "
           f"{_ms(ttft_f)} | {_ms(ttft_f - ttft_d)} | {_ms(tok_d)} | {_ms(tok_f)} | {_ms(tok_f - tok_d)} |")
    return f"{header}\n{row}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton-grpc", help="use a running tritonserver (with --openai-url) instead of starting one")
    ap.add_argument("--openai-url", help="the running frontend, e.g. http://127.0.0.1:9000")
    ap.add_argument("--model", default="llm", help="Triton model name")
    ap.add_argument("--model-dir", default=str(ROOT / "models" / "tiny-llama"),
                    help="weights for the stack this script starts")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="requests per arm per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="no new request starts after this")
    args = ap.parse_args()

    if bool(args.triton_grpc) != bool(args.openai_url):
        ap.error("give both --triton-grpc and --openai-url, or neither")
    if args.triton_grpc:
        _require_loopback(args.triton_grpc.rsplit(":", 1)[0])
        _require_loopback(urlparse(args.openai_url).hostname or "")
        args.model_label = args.model
        results = asyncio.run(measure(args, args.triton_grpc, args.openai_url))
    else:
        args.model_label = Path(args.model_dir).name
        with tempfile.TemporaryDirectory(prefix="openai_overhead-") as tmp:
            repo = make_model_repository(ROOT / "model_repository", Path(tmp) / "repo",
                                         {args.model: {"model": Path(args.model_dir).resolve()}})
            with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
                with FrontendProcess(server.grpc_url, Path(tmp) / "frontend.log") as frontend:
                    results = asyncio.run(measure(args, server.grpc_url, frontend.base_url))
    print(report(args, results))


if __name__ == "__main__":
    main()
