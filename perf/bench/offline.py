"""Offline benchmark: in-flight engine vs Hugging Face generate in static padded batches, on this CPU.

Workload: N requests whose output lengths are the seeds' 20/50/200/800 mix in equal shares, scaled by
--scale; prompts of 16-64 tokens. Reports engine tokens/s vs HF static batches of the same size, single
stream time per token vs HF at batch 1, and the scheduler's CPU time per step.

    .venv/bin/python -m perf.bench.offline            # full run (~ a few minutes on 2 cores)
    .venv/bin/python -m perf.bench.offline --quick    # smaller, for a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch
from transformers import AutoModelForCausalLM

from inflight import LLM, SamplingParams
from inflight.model.linear import cpu_gemm_choice
from inflight.step_timer import StepTimer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIX = [20, 50, 200, 800]


def workload(tokenizer, num_requests: int, scale: float, seed: int = 0):
    rng = random.Random(seed)
    vocab_text = tokenizer.encode("The quick brown fox jumps over the lazy dog while the river runs to the sea. " * 20)
    reqs = []
    for i in range(num_requests):
        plen = rng.randint(16, 64)
        start = rng.randint(0, len(vocab_text) - plen)
        out_len = max(1, int(MIX[i % len(MIX)] * scale))
        reqs.append((vocab_text[start:start + plen], out_len))
    rng.shuffle(reqs)
    return reqs


def run_engine(model: str, reqs, batch: int) -> dict:
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=512, num_kv_blocks=1024, block_size=16)
    engine = llm.engine
    sched_time = [0.0]
    schedule = engine.scheduler.schedule

    def timed_schedule(members=None):  # CPU time of the scheduling decision alone (the wall-time phases are below)
        # This thread's time only: process time would add what a spinning OpenMP worker burns meanwhile.
        t = time.thread_time()
        out = schedule(members)
        sched_time[0] += time.thread_time() - t
        return out

    engine.scheduler.schedule = timed_schedule
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    llm.generate([reqs[0][0]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warm-up
    timer = StepTimer()
    engine.set_step_timer(timer)
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    engine.set_step_timer(None)
    steps = timer.num_steps
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs), "engine produced a wrong number of tokens"
    phases = {k: round(1000 * v / max(steps, 1), 3) for k, v in timer.totals.items()}
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "steps": steps,
            "scheduler_ms_per_step": 1000 * sched_time[0] / max(steps, 1), "wall_ms_per_step_by_phase": phases}


def run_hf_static(model_path: str, reqs, batch: int, pad_id: int) -> dict:
    """HF generate over static batches: each batch is left-padded and runs until its longest request ends."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokens = 0
    t = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        tokens += sum(n for _, n in chunk)  # useful tokens only: padding steps are waste
        print(f"  hf static batch {i // batch + 1}/{(len(reqs) + batch - 1) // batch} done", flush=True)
    elapsed = time.perf_counter() - t
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def single_stream(model_path: str, prompt, n: int) -> dict:
    llm = LLM(model_path, num_kv_blocks=256)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    ours = (time.perf_counter() - t) / n
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf = (time.perf_counter() - t) / n
    return {"engine_ms_per_token": 1000 * ours, "hf_ms_per_token": 1000 * hf}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="engine max_num_seqs and HF static batch size")
    ap.add_argument("--scale", type=float, default=0.25, help="scales the 20/50/200/800 output mix")
    ap.add_argument("--quick", action="store_true", help="16 requests, scale 0.05")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.scale = 16, 0.05
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]
    llm_tok = LLM(args.model, num_kv_blocks=8).tokenizer
    reqs = workload(llm_tok, args.num_requests, args.scale)
    print(f"workload: {len(reqs)} requests, outputs {sorted({n for _, n in reqs})}, batch {args.batch}", flush=True)
    engine = run_engine(args.model, reqs, args.batch)
    print(f"engine: {engine}", flush=True)
    hf = run_hf_static(args.model, reqs, args.batch, llm_tok.pad_token_id or 0)
    print(f"hf static: {hf}", flush=True)
    single = single_stream(args.model, reqs[0][0], 32 if args.quick else 64)
    print(f"single stream: {single}", flush=True)
    result = {"workload": {"num_requests": len(reqs), "batch": args.batch, "scale": args.scale,
                           "threads": torch.get_num_threads(), "engine_cpu_gemm": cpu_gemm_choice(),
                           "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
              "engine": engine, "hf_static": hf, "single_stream": single,
              "throughput_ratio": engine["tokens_per_s"] / hf["tokens_per_s"],
              "single_stream_ratio": single["hf_ms_per_token"] / single["engine_ms_per_token"]}
    print("\n| metric | engine | HF | ratio |\n|---|---|---|---|")
    print(f"| mixed workload tokens/s | {engine['tokens_per_s']:.1f} | {hf['tokens_per_s']:.1f} | "
          f"{result['throughput_ratio']:.2f}x |")
    print(f"| single stream ms/token | {single['engine_ms_per_token']:.1f} | {single['hf_ms_per_token']:.1f} | "
          f"{result['single_stream_ratio']:.2f}x |")
    print(f"| scheduler CPU ms/step | {engine['scheduler_ms_per_step']:.3f} | | |")
    print("\nengine wall ms per step by phase: " + ", ".join(
        f"{k} {v:.2f}" for k, v in engine["wall_ms_per_step_by_phase"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
