"""Probe: what does quantization cost in accuracy? Perplexity on a fixed text, float32 vs int8 vs int4 (and GGUF).

The text is this repository's own docs (docs/*.md in name order, so it changes only when they do), cut into
windows of --window tokens; each window runs as one prefill through the engine's model (the same forward and
paged attention that serve requests), and every position's next-token log-probability counts. Also greedy
agreement: the fidelity prompts' 24-token greedy outputs, compared with float32's token for token up to the first
difference.

    .venv/bin/python -m perf.probes.perplexity --json perf/results/quantization/perplexity.json
    .venv/bin/python -m perf.probes.perplexity \
        --models none,int8,int4,gguf:models/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import inflight  # noqa: F401, I001 - first: it sets OMP_WAIT_POLICY before torch loads OpenMP, as served
import torch

from inflight import LLM, SamplingParams
from inflight.sequence import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def corpus() -> str:
    return "\n\n".join(open(p).read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))


def prompt_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits (float32) from one prefill of ids through the engine's runner, outside the
    scheduler: its blocks are taken and given back here."""
    engine = llm.engine
    seq = Sequence("prompt-logits", ids, SamplingParams(max_tokens=1), 1)
    engine.block_manager.admit(seq)
    engine.block_manager.allocate(seq, len(seq))
    try:
        runner = engine.runner
        with torch.inference_mode():
            input_ids, positions, meta, _, _ = runner.prepare([(seq, len(seq))])
            hidden = runner.forward(input_ids, positions, meta, runner.kv_caches)
            return runner.model.compute_logits(hidden).float()
    finally:
        engine.block_manager.free(seq)


def window_nll(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given their prefixes, in one prefill, and the count."""
    logp = torch.log_softmax(prompt_logits(llm, ids)[:-1], dim=-1)
    target = torch.tensor(ids[1:])
    nll = -logp[torch.arange(len(target)), target].double().sum().item()
    return nll, len(ids) - 1


def measure(model: str, quantization: str, window: int, max_windows: int, greedy_prompts: list[list[int]]) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, quantization=quantization, num_kv_blocks=window // 16 + 4, max_model_len=window,
              max_num_batched_tokens=window, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(corpus())
    total, count = 0.0, 0
    for start in range(0, min(len(ids) - 1, max_windows * window), window):
        nll, n = window_nll(llm, ids[start:start + window])
        total, count = total + nll, count + n
    outs = llm.generate(greedy_prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return {"perplexity": math.exp(total / count), "tokens": count, "seconds": round(time.perf_counter() - t0, 1),
            "greedy": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="none,int8,int4",
                    help="comma-separated: none/int8/int4 (SmolLM2 quantized at load) or gguf:PATH")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    tokenizer_llm_ids = LLM(SMOLLM2, num_kv_blocks=8).tokenizer.encode(corpus())
    greedy_prompts = [tokenizer_llm_ids[1000 + 300 * i: 1000 + 300 * i + 32] for i in range(8)]
    results = {}
    for spec in args.models.split(","):
        model, quantization = (spec[5:], "none") if spec.startswith("gguf:") else (SMOLLM2, spec)
        results[spec] = measure(model, quantization, args.window, args.max_windows, greedy_prompts)
    base = results.get("none")
    for spec, r in results.items():
        if base and spec != "none":
            r["perplexity_vs_float32"] = round(r["perplexity"] / base["perplexity"] - 1, 5)
            agree = [_common_prefix(a, b) for a, b in zip(base["greedy"], r["greedy"])]
            r["greedy_tokens_before_first_difference"] = agree
            r["greedy_identical_prompts"] = sum(n == 24 for n in agree)
        print(f"{spec}: perplexity {r['perplexity']:.4f} over {r['tokens']} tokens"
              + (f", {100 * r['perplexity_vs_float32']:+.2f}% vs float32, greedy identical on "
                 f"{r['greedy_identical_prompts']}/8 prompts" if "perplexity_vs_float32" in r else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
