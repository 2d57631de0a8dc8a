"""GPU benchmark: offline engine throughput on a nano-vllm-style load with a 0.5B Qwen2-shaped model.

The model has random weights (no hub): it is written as an HF folder (config.json + safetensors + a
generated word-level tokenizer) in a temp dir, so the engine's own loader and tokenizer path are used.

    python perf/gpu_bench.py --out results/          # one H100/H200: well under 8 minutes
    python perf/gpu_bench.py --smoke --out /tmp/x    # CPU, tiny model, Triton in the interpreter

Reports: output tokens/s over the whole load (256 requests, prompt and output lengths uniform in
100-1024, ignore_eos); the step-time breakdown (schedule, prepare, forward, sample, detokenize, other;
the device is synchronised at each mark); the decode roofline fraction (bytes of weights + KV read per
decode step / HBM bandwidth, over the measured step time); greedy equality of the Triton kernels against
the torch reference attention (and of CUDA-graph decodes against eager ones), with first-step logits
compared within a tolerance, since bf16 greedy paths may part late. Writes gpu_bench-<gpu>.json and
.md under --out, after every phase, so a run cut short still leaves what it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

# Without a GPU the Triton kernels run only in the interpreter, which must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from inflight import LLM, SamplingParams  # noqa: E402
from inflight.attention import BACKEND_ENV  # noqa: E402
from inflight.step_timer import PHASES, StepTimer  # noqa: E402

log = logging.getLogger("gpu_bench")

# HBM bandwidth by device name (vendor datasheets), B/s; the first substring that matches wins.
HBM_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12)]


@dataclass
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


QWEN2_05B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)


@dataclass
class Load:
    num_requests: int
    min_len: int
    max_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    check_prompt_lens: tuple[int, ...]
    check_tokens: int


FULL = Load(256, 100, 1024, 256, 16384, 4096, (17, 130, 509, 1000), 32)
SMOKE = Load(8, 8, 32, 8, 64, 128, (5, 12), 4)


# ---- the model folder ---------------------------------------------------------------------------
def write_model(path: str, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> int:
    """A Qwen2-shaped HF folder with random weights; returns the parameter count."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    head_dim = shape.hidden // shape.heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:  # generated on the device: 0.5B normals on a CPU take a while
        return (0.02 * torch.randn(*size, generator=gen, device=device, dtype=torch.float32)).to(dtype).cpu()

    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    tensors = {"model.embed_tokens.weight": randn(shape.vocab, shape.hidden),
               "model.norm.weight": torch.ones(shape.hidden, dtype=dtype)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(shape.hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(shape.hidden, dtype=dtype),
            p + "self_attn.q_proj.weight": randn(q, shape.hidden), p + "self_attn.q_proj.bias": randn(q),
            p + "self_attn.k_proj.weight": randn(kv, shape.hidden), p + "self_attn.k_proj.bias": randn(kv),
            p + "self_attn.v_proj.weight": randn(kv, shape.hidden), p + "self_attn.v_proj.bias": randn(kv),
            p + "self_attn.o_proj.weight": randn(shape.hidden, q),
            p + "mlp.gate_proj.weight": randn(shape.intermediate, shape.hidden),
            p + "mlp.up_proj.weight": randn(shape.intermediate, shape.hidden),
            p + "mlp.down_proj.weight": randn(shape.hidden, shape.intermediate),
        })
    save_file(tensors, os.path.join(path, "model.safetensors"))

    # A word-level tokenizer over every id ("t0", "t1", ...): the engine loads it with AutoTokenizer, and
    # detokenization costs what a real tokenizer's decode of a few tokens costs.
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t1", "unk_token": "t0",
                   "model_max_length": 1 << 20}, f)
    return sum(t.numel() for t in tensors.values())


# ---- helpers --------------------------------------------------------------------------------------
def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "unknown"


def default_bandwidth(name: str) -> float | None:
    for key, bw in HBM_BANDWIDTH:
        if key in name:
            return bw
    return None


def random_prompts(rng: random.Random, lens, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def free_engine(llm) -> None:
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record_logits(llm, steps: int) -> list[torch.Tensor]:
    """The first `steps` logits the runner computes, copied to the CPU in fp32."""
    runner = llm.engine.runner
    model = runner.model
    original = model.compute_logits
    seen: list[torch.Tensor] = []

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        if len(seen) < steps:
            seen.append(out.float().cpu())
        return out
    model.compute_logits = recording
    return seen


def greedy_run(llm, prompts, tokens: int, backend: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    os.environ[BACKEND_ENV] = backend  # the dispatcher reads it per call
    try:
        seen = record_logits(llm, 2)  # the prefill step and the first decode step
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.token_ids for o in outs], seen
    finally:
        del llm.engine.runner.model.compute_logits  # back to the class's method
        os.environ.pop(BACKEND_ENV, None)


def compare(name: str, a_ids, a_logits, b_ids, b_logits, tolerance: float) -> dict:
    """Greedy ids equal, or where they first part; logits of the first two steps as relative L2 errors."""
    diverged = []
    for i, (x, y) in enumerate(zip(a_ids, b_ids)):
        if x != y:
            at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            diverged.append({"prompt": i, "first_divergence": at, "of": len(x)})
    errors = []
    for x, y in zip(a_logits, b_logits):
        errors.append(float((x - y).norm() / y.norm().clamp_min(1e-30)))
    result = {"name": name, "greedy_equal": not diverged, "divergences": diverged,
              "logits_rel_err": errors, "logits_tolerance": tolerance,
              "logits_ok": bool(errors) and all(e <= tolerance for e in errors)}
    log.info("check %s: greedy %s, logits rel err %s", name, "equal" if not diverged else diverged, errors)
    return result


# ---- phases ---------------------------------------------------------------------------------------
def kernel_check(model_dir: str, load: Load, vocab: int, device: str, tolerance: float) -> tuple[dict, dict]:
    """Triton kernels vs the torch reference attention, eager, on one engine (prefix caching off, so the
    second run recomputes everything). Returns the comparison and each backend's (ids, logits)."""
    prompts = random_prompts(random.Random(1), load.check_prompt_lens, vocab)
    tokens = sum(load.check_prompt_lens) + len(prompts) * load.check_tokens
    llm = LLM(model_dir, device=device, enforce_eager=True, enable_prefix_caching=False,
              num_kv_blocks=tokens // 4 + 16,  # 4x what block_size 16 needs: no preemption
              max_num_seqs=len(prompts), max_num_batched_tokens=max(sum(load.check_prompt_lens), 64),
              max_model_len=load.max_model_len)
    runs = {backend: greedy_run(llm, prompts, load.check_tokens, backend) for backend in ("triton", "torch")}
    free_engine(llm)
    return compare("triton_vs_torch_attention", *runs["triton"], *runs["torch"], tolerance), runs


def throughput(llm, load: Load, vocab: int, seed: int, time_limit: float) -> dict:
    rng = random.Random(seed)
    prompt_lens = [rng.randint(load.min_len, load.max_len) for _ in range(load.num_requests)]
    output_lens = [rng.randint(load.min_len, load.max_len) for _ in range(load.num_requests)]
    prompts = random_prompts(rng, prompt_lens, vocab)
    engine = llm.engine
    # Warm-up: one short request (first-call costs outside the timed run).
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    batches = []  # per non-empty step: (seqs, tokens, decode-only, context tokens read)
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out.scheduled:
            decode = all(n == 1 for _, n in out.scheduled)
            ctx = sum(s.num_computed_tokens + n for s, n in out.scheduled)
            batches.append((len(out.scheduled), out.num_batched_tokens, decode, ctx))
        return out
    engine.scheduler.schedule = recording_schedule
    timer = StepTimer(sync=True, keep_steps=True)
    engine.set_step_timer(timer)

    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"bench-{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out_tokens, truncated = 0, False
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            out_tokens += len(out.new_token_ids)
        if time.perf_counter() - t0 > time_limit:
            truncated = True
            for rid in list(engine.seqs):
                engine.abort_request(rid)
            break
    elapsed = time.perf_counter() - t0
    engine.set_step_timer(None)
    del engine.scheduler.schedule
    n = timer.num_steps
    return {
        "requests": load.num_requests, "prompt_tokens": sum(prompt_lens), "output_tokens": out_tokens,
        "expected_output_tokens": sum(output_lens), "truncated_at_time_limit": truncated,
        "seconds": elapsed, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + sum(prompt_lens)) / elapsed if not truncated else None,
        "steps": n, "decode_steps": sum(1 for b in batches if b[2]),
        "phase_seconds": timer.totals, "phase_ms_per_step": {k: 1000 * v / max(n, 1) for k, v in timer.totals.items()},
        "_steps": timer.steps, "_batches": batches,
    }


def roofline(run: dict, weight_bytes: int, kv_bytes_per_token: int, bandwidth: float | None,
             full_batch: int) -> dict:
    """Bytes a decode step must read (every weight once, each sequence's KV context) over the bandwidth,
    against the measured forward (device synced) and whole-step times."""
    rows = []
    for laps, (seqs, _, decode, ctx) in zip(run["_steps"], run["_batches"]):
        if decode:
            rows.append((seqs, weight_bytes + ctx * kv_bytes_per_token, laps.get("forward", 0.0),
                         sum(laps.values())))
    result = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token, "hbm_bandwidth": bandwidth}
    for name, sel in (("all_decode_steps", rows), ("full_batch_decode_steps", [r for r in rows if r[0] >= full_batch])):
        if not sel:
            result[name] = None
            continue
        nbytes = sum(r[1] for r in sel)
        fwd, step = sum(r[2] for r in sel), sum(r[3] for r in sel)
        entry = {"steps": len(sel), "mean_seqs": sum(r[0] for r in sel) / len(sel),
                 "mean_bytes_per_step": nbytes / len(sel), "mean_forward_ms": 1000 * fwd / len(sel),
                 "mean_step_ms": 1000 * step / len(sel)}
        if bandwidth:
            ideal = nbytes / bandwidth
            entry.update(ideal_ms=1000 * ideal / len(sel), fraction_of_forward=ideal / fwd if fwd else None,
                         fraction_of_step=ideal / step if step else None)
        result[name] = entry
    return result


# ---- report ---------------------------------------------------------------------------------------
def write_report(out_dir: str, report: dict) -> dict:
    """Write gpu_bench-<device>.json and .md (per-step records left out); returns what was written."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"gpu_bench-{slug(report['device'])}")
    public = dict(report)
    if "throughput" in public:
        public["throughput"] = {k: v for k, v in public["throughput"].items() if not k.startswith("_")}
    with open(base + ".json", "w") as f:
        json.dump(public, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(markdown(public))
    return public


def _fmt(v, spec: str = ".3g") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(r: dict) -> str:
    lines = [f"# gpu_bench on {r['device']}", "",
             f"{r['when']}; torch {r['torch']}; {'smoke (tiny model, CPU-sized load)' if r['smoke'] else 'full load'}; "
             f"model {r['model']['shape']} ({r['model']['params'] / 1e6:.1f}M params, {r['model']['dtype']}, "
             "random weights)", ""]
    if r.get("engine"):
        e = r["engine"]
        lines += [f"Engine: {e['num_kv_blocks']} KV blocks ({_fmt(e['kv_cache_gib'], '.2f')} GiB), CUDA graphs for "
                  f"{e['graph_buckets'] or 'none'}, fused ops {e['fused_ops']}, init {e['init_s']:.1f} s.", ""]
    t = r.get("throughput")
    if t:
        lines += ["| output tok/s | output tokens | seconds | steps | decode steps | truncated |",
                  "|---|---|---|---|---|---|",
                  f"| {t['output_tokens_per_s']:.0f} | {t['output_tokens']} | {t['seconds']:.1f} | {t['steps']} | "
                  f"{t['decode_steps']} | {t['truncated_at_time_limit']} |", "",
                  "Step-time breakdown, ms per step (device synchronised at each mark):", "",
                  "| " + " | ".join(PHASES) + " |", "|" + "---|" * len(PHASES),
                  "| " + " | ".join(f"{t['phase_ms_per_step'][p]:.2f}" for p in PHASES) + " |", ""]
    rf = r.get("roofline")
    if rf:
        lines += [f"Decode roofline: weights {rf['weight_bytes'] / 1e9:.3f} GB + {rf['kv_bytes_per_token']} B of KV "
                  f"per context token per step, HBM {_fmt(rf['hbm_bandwidth'])} B/s.", "",
                  "| steps | count | mean seqs | ideal ms | forward ms | step ms | of forward | of step |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in ("full_batch_decode_steps", "all_decode_steps"):
            e = rf.get(name)
            if e:
                lines.append(f"| {name} | {e['steps']} | {e['mean_seqs']:.0f} | {_fmt(e.get('ideal_ms'))} | "
                             f"{e['mean_forward_ms']:.3g} | {e['mean_step_ms']:.3g} | "
                             f"{_fmt(e.get('fraction_of_forward'), '.1%')} | "
                             f"{_fmt(e.get('fraction_of_step'), '.1%')} |")
        lines.append("")
    for c in r.get("checks", []):
        greedy = "equal" if c["greedy_equal"] else f"diverged {c['divergences']}"
        errors = ", ".join(format(e, ".2e") for e in c["logits_rel_err"])
        lines.append(f"- check `{c['name']}`: greedy {greedy}; logits rel err {errors} "
                     f"(tolerance {c['logits_tolerance']}: {'ok' if c['logits_ok'] else 'OVER'})")
    if r.get("errors"):
        lines += ["", "Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


# ---- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "perf", "results", "gpu_bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny model and load (CPU: Triton in the interpreter)")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hbm-bandwidth", type=float,
                    help="B/s; default from the device name (H100 SXM 3.35e12, H200 4.8e12)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds for the timed run; requests still running then are aborted and it says so")
    ap.add_argument("--logits-tolerance", type=float, help="relative L2 error allowed (default 3e-2 bf16, 1e-4 fp32)")
    ap.add_argument("--skip-check", action="store_true", help="no Triton-vs-torch / graph-vs-eager checks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape, load = (TINY, SMOKE) if args.smoke else (QWEN2_05B, FULL)
    if args.num_requests:
        load.num_requests = args.num_requests
    dtype = torch.bfloat16 if cuda else torch.float32  # what the engine's dtype=auto picks
    tolerance = args.logits_tolerance or (3e-2 if dtype == torch.bfloat16 else 1e-4)
    bandwidth = args.hbm_bandwidth or default_bandwidth(device_name())
    report = {"device": device_name() + ("-smoke" if args.smoke else ""), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "torch": torch.__version__, "smoke": args.smoke, "load": load.__dict__, "checks": [], "errors": []}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_bench_model_") as model_dir:
        t = time.perf_counter()
        params = write_model(model_dir, shape, torch.device(device), dtype, args.seed)
        report["model"] = {"shape": shape.__dict__, "params": params, "dtype": str(dtype),
                           "write_s": time.perf_counter() - t}
        write_report(args.out, report)

        check_runs = None
        if not args.skip_check:
            try:
                check, check_runs = kernel_check(model_dir, load, shape.vocab, device, tolerance)
                report["checks"].append(check)
            except Exception as e:  # noqa: BLE001 - report it and go on to the throughput run
                log.exception("kernel check failed")
                report["errors"].append(f"kernel check: {type(e).__name__}: {e}")
            write_report(args.out, report)

        t = time.perf_counter()
        options = dict(device=device, max_num_seqs=load.max_num_seqs, max_model_len=load.max_model_len,
                       max_num_batched_tokens=load.max_num_batched_tokens,
                       gpu_memory_utilization=args.gpu_memory_utilization)
        # The CPU pool is a byte budget, and a GPU fraction would be millions of tiny-model blocks: size
        # both to the load instead.
        if not cuda or args.smoke:
            options["num_kv_blocks"] = 4 * load.max_num_seqs * load.max_model_len // 16
        llm = LLM(model_dir, **options)
        runner = llm.engine.runner
        if not cuda:  # no graphs to capture: still run the padded static-buffer decode they replay
            runner.enable_static_decode(capture=False)
        static = runner.static_decode
        report["engine"] = {
            "init_s": time.perf_counter() - t, "num_kv_blocks": runner.num_blocks,
            "kv_cache_gib": runner.num_blocks * runner.bytes_per_block() / 2**30,
            "graph_buckets": sorted(static.graphs) if static else [], "fused_ops": runner.forward is not runner.model,
            "options": options}
        write_report(args.out, report)

        run = throughput(llm, load, shape.vocab, args.seed, args.time_limit)
        report["throughput"] = run
        mc = runner.model_config
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # tied: counted once
        elem = torch.tensor([], dtype=runner.dtype).element_size()
        kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
        report["roofline"] = roofline(run, weight_bytes, kv_per_token, bandwidth, load.max_num_seqs)
        write_report(args.out, report)

        if check_runs is not None:
            # The check prompts through this engine, whose decodes replay CUDA graphs (on CPU: the padded
            # static-buffer path, eagerly), against the eager run with the same attention backend.
            backend = "triton" if cuda else "torch"
            try:
                prompts = random_prompts(random.Random(1), load.check_prompt_lens, shape.vocab)
                ids, logits = greedy_run(llm, prompts, load.check_tokens, backend)
                report["checks"].append(compare("static_decode_vs_eager", ids, logits, *check_runs[backend], tolerance))
            except Exception as e:  # noqa: BLE001
                log.exception("graph check failed")
                report["errors"].append(f"graph check: {type(e).__name__}: {e}")
        report["total_s"] = time.perf_counter() - t_start
        public = write_report(args.out, report)
        free_engine(llm)
    print(markdown(public))
    failed = report["errors"] or any(not c["logits_ok"] for c in report["checks"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
