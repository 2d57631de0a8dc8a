"""Probe: how far may bf16 logits part between two attentions that round differently? (gpu/bench.py's tolerance)

The logits tolerance of gpu_bench's Triton-vs-reference check in bf16, derived on this CPU.

gpu_bench compares the first two steps' logits (prefill, then one decode) of its check prompts between an
engine whose attention is the Triton kernel and one whose attention is the torch reference, both bf16, on
the 0.5B Qwen2-shaped random model. The two differ only in how attention rounds: the kernel multiplies bf16
Q and K into fp32, takes an fp32 softmax, rounds the unnormalised probabilities to bf16 for P x V (fp32
accumulation), and divides in fp32; the reference is torch's bf16 scaled_dot_product_attention. This runs
the same comparison on CPU with the reference against a torch emulation of the kernel's rounding, and
against attention computed in fp32 and rounded once (the most accurate bf16 result), and prints the
relative L2 errors; the tolerance is set a few times above the largest.

    .venv/bin/python -m perf.probes.bf16_tolerance --json perf/results/host_overhead/bf16_tolerance.json  # ~minutes
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from perf.gpu.bench import FULL, QWEN2_05B, compare, random_prompts, record_logits, write_model
from inflight import LLM, SamplingParams
from inflight.attention import reference


def kernel_like_attention(query, k_cache, v_cache, meta, scale):
    """The Triton kernel's rounding points in torch: fp32 scores of bf16 Q, K; fp32 softmax; unnormalised P
    rounded to the input dtype for P x V in fp32; fp32 normalisation; output in the input dtype."""
    return _per_sequence(query, k_cache, v_cache, meta, scale, round_p=True)


def fp32_attention(query, k_cache, v_cache, meta, scale):
    """Attention in fp32 throughout, rounded once at the end."""
    return _per_sequence(query, k_cache, v_cache, meta, scale, round_p=False)


def _per_sequence(query, k_cache, v_cache, meta, scale, round_p: bool):
    out = torch.empty_like(query)
    group = query.shape[1] // k_cache.shape[2]
    start = 0
    for i, q_len in enumerate(meta.query_lens):
        ctx = meta.seq_lens_host[i]
        k = reference._gather_context(k_cache, meta.block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        v = reference._gather_context(v_cache, meta.block_tables[i], ctx).float().repeat_interleave(group, dim=1)
        q = query[start:start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        scores.masked_fill_(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        total = p.sum(dim=-1, keepdim=True)
        if round_p:
            p = p.to(query.dtype).float()
        o = torch.einsum("hqk,khd->qhd", p, v) / total.transpose(0, 1)
        out[start:start + q_len] = o.to(query.dtype)
        start += q_len
    return out


def run(llm, prompts, attention_fn) -> tuple[list[list[int]], list[torch.Tensor]]:
    original = reference.paged_attention
    if attention_fn is not None:
        reference.paged_attention = attention_fn
    try:
        seen = record_logits(llm, 2)
        outs = llm.generate(prompts, SamplingParams(max_tokens=FULL.check_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        return [o.token_ids for o in outs], seen
    finally:
        reference.paged_attention = original
        del llm.engine.runner.model.compute_logits


def main(argv=None) -> int:
    # The eager forward: its attention is what run() swaps (the compiled CPU forward has its own).
    os.environ["INFLIGHT_CPU_COMPILE"] = "0"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--prompt-lens", default=",".join(map(str, FULL.check_prompt_lens)))
    args = ap.parse_args(argv)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bf16_tol_") as model_dir:
        write_model(model_dir, QWEN2_05B, torch.device("cpu"), torch.bfloat16, seed=0)
        prompts = random_prompts(random.Random(1), lens, QWEN2_05B.vocab)  # gpu_bench's check prompts
        llm = LLM(model_dir, dtype="bfloat16", enable_prefix_caching=False, num_kv_blocks=sum(lens) // 4 + 64,
                  max_num_seqs=len(prompts), max_num_batched_tokens=max(sum(lens), 64),
                  max_model_len=FULL.max_model_len)
        ref = run(llm, prompts, None)
        results = [compare(name, *run(llm, prompts, fn), *ref, tolerance=float("inf"))
                   for name, fn in (("kernel_rounding_vs_reference", kernel_like_attention),
                                    ("fp32_attention_vs_reference", fp32_attention))]
    worst = max(e for r in results for e in r["logits_rel_err"])
    report = {"prompt_lens": lens, "model": "Qwen2-0.5B shape, random weights, bf16, CPU", "results": results,
              "largest_rel_err": worst, "seconds": time.perf_counter() - t0}
    for r in results:
        print(f"{r['name']}: logits rel err {['%.2e' % e for e in r['logits_rel_err']]}, greedy "
              f"{'equal' if r['greedy_equal'] else r['divergences']}")
    print(f"largest {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
