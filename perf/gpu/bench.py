"""GPU benchmark: offline engine throughput on a nano-vllm-style load with a 0.5B Qwen2-shaped model.

The model has random weights (no hub): it is written as an HF folder (config.json + safetensors + a
generated word-level tokenizer) in a temp dir, so the engine's own loader and tokenizer path are used.

    python -m perf.gpu.bench --out results/          # one H100/H200: well under 8 minutes
    python -m perf.gpu.bench --smoke --out /tmp/x    # CPU, tiny model, Triton in the interpreter

Steps (main): set up; write the model; check the Triton kernels against the torch reference attention
(greedy ids, first-step logits within a tolerance: bf16 paths may part late); start the benchmark engine;
the throughput run (256 requests, prompt and output lengths uniform in 100-1024, ignore_eos; output tokens/s
with no step timer, which would sync the device at every phase mark); the breakdown run, a short one with
the same batch shape, timed twice: host view (no syncs: how long the host takes to reach each mark, the
sampler's lap holding the wait for the device) and device view (synced at each mark: the decode roofline
fraction, bytes of weights + KV read per decode step / HBM bandwidth over the measured forward); the sync
check (CUDA: preparing a step makes no synchronising call and the sampler at most two, the reads of its
results); CUDA-graph decodes against eager ones; the report. gpu_bench-<gpu>.json and .md are written under
--out after every step, so a run cut short still leaves what it measured.
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
import warnings
from dataclasses import dataclass, field

import torch

# Which Triton the kernels get is fixed when triton is first imported. Without a GPU that can only be the
# interpreter; with one, an inherited TRITON_INTERPRET=1 would silently benchmark the interpreter.
INHERITED_INTERPRET = None
if torch.cuda.is_available():
    INHERITED_INTERPRET = os.environ.pop("TRITON_INTERPRET", None)
    if INHERITED_INTERPRET not in (None, "", "0"):
        print(f"gpu_bench: unset the inherited TRITON_INTERPRET={INHERITED_INTERPRET}: this host has CUDA",
              file=sys.stderr)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inflight import LLM, SamplingParams  # noqa: E402
from inflight.attention import BACKEND_ENV  # noqa: E402
from inflight.step_timer import PHASES, StepTimer  # noqa: E402

log = logging.getLogger("gpu_bench")

# HBM bandwidth by device name (vendor datasheets), B/s; the first substring that matches wins.
HBM_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12)]
# Relative L2 error allowed between the first two steps' logits of two bf16 engines whose attention rounds
# differently. perf/probes/bf16_tolerance.py ran the same comparison on CPU with one change of rounding in attention
# (the kernel's bf16 P x V, or fp32 attention rounded once, against torch's bf16 attention): 1.8e-2 to 2.0e-2,
# greedy ids parting after 6-21 tokens (perf/results/host_overhead/bf16_tolerance.json). Three times that
# leaves room for the GPU's different summation orders, and is far below what a wrong index or mask does.
BF16_LOGITS_TOLERANCE = 6e-2


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
    breakdown_tokens: int  # output tokens per request in the breakdown run


FULL = Load(256, 100, 1024, 256, 16384, 4096, (17, 130, 509, 1000), 32, 48)
SMOKE = Load(8, 8, 32, 8, 64, 128, (5, 12), 4, 6)


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


def bench_requests(load: Load, vocab: int, seed: int, output_tokens: int | None = None):
    """The load's prompts (token ids) and output lengths: uniform in [min_len, max_len] unless fixed."""
    rng = random.Random(seed)
    prompt_lens = [rng.randint(load.min_len, load.max_len) for _ in range(load.num_requests)]
    output_lens = [output_tokens or rng.randint(load.min_len, load.max_len) for _ in range(load.num_requests)]
    return random_prompts(rng, prompt_lens, vocab), output_lens


def run_load(engine, prompts, output_lens, time_limit: float, tag: str) -> dict:
    """Every request to completion (or the time limit: the rest are aborted); output tokens and seconds."""
    for i, (p, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
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
    return {"output_tokens": out_tokens, "seconds": time.perf_counter() - t0, "truncated_at_time_limit": truncated}


def throughput(llm, load: Load, vocab: int, seed: int, time_limit: float) -> dict:
    """The headline: output tokens/s with no step timer (a synced timer would stall the device six times a
    step)."""
    prompts, output_lens = bench_requests(load, vocab, seed)
    # Warm-up: one short request (first-call costs outside the timed run).
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    run = run_load(llm.engine, prompts, output_lens, time_limit, "bench")
    elapsed = run["seconds"]
    run.update({
        "requests": load.num_requests, "prompt_tokens": sum(len(p) for p in prompts),
        "expected_output_tokens": sum(output_lens), "output_tokens_per_s": run["output_tokens"] / elapsed,
        "total_tokens_per_s": None if run["truncated_at_time_limit"]
        else (run["output_tokens"] + sum(len(p) for p in prompts)) / elapsed})
    return run


def _record_batches(engine) -> list:
    """Per non-empty step from now on: (seqs, tokens, decode-only, context tokens read)."""
    batches = []
    schedule = engine.scheduler.schedule

    def recording_schedule(members=None):
        out = schedule(members)
        if out.scheduled:
            decode = all(n == 1 for _, n in out.scheduled)
            ctx = sum(s.num_computed_tokens + n for s, n in out.scheduled)
            batches.append((len(out.scheduled), out.num_batched_tokens, decode, ctx))
        return out
    engine.scheduler.schedule = recording_schedule
    return batches


def _phase_means(laps: list[dict], batches: list, full_batch: int) -> dict:
    """ms per step by phase: over all steps, and over the decode steps with the batch full."""
    def means(sel):
        return {p: 1000 * sum(lap.get(p, 0.0) for lap in sel) / len(sel) for p in PHASES} if sel else None
    full = [lap for lap, b in zip(laps, batches) if b[2] and b[0] >= full_batch]
    return {"all_steps": means(laps), "full_batch_decode_steps": means(full), "full_batch_decode_count": len(full)}


def breakdown(llm, load: Load, vocab: int, seed: int, time_limit: float) -> dict:
    """A short run of the same batch shape (every request admitted, then decodes with the batch full), twice.

    host view: StepTimer without syncs, so each lap is host time up to that mark; the device's work shows up
    in the lap that waits for it, `sample` (the sampler reads its tokens). What the device waits for is the
    rest: schedule, prepare, forward (launch), detokenize, other (`overlap` runs while the forward does).
    device view: synced at every mark, so each lap holds the device work it queued; gives the roofline.
    """
    engine = llm.engine
    result = {}
    for view, sync in (("host_view", False), ("device_view", True)):
        prompts, output_lens = bench_requests(load, vocab, seed + 1, load.breakdown_tokens)
        batches = _record_batches(engine)
        timer = StepTimer(sync=sync, keep_steps=True)
        engine.set_step_timer(timer)
        try:
            run = run_load(engine, prompts, output_lens, time_limit, f"breakdown-{view}")
        finally:
            engine.set_step_timer(None)
            del engine.scheduler.schedule
        run.update(steps=timer.num_steps, decode_steps=sum(1 for b in batches if b[2]),
                   **_phase_means(timer.steps, batches, load.max_num_seqs))
        if sync:
            run.update(_steps=timer.steps, _batches=batches)
        result[view] = run
    host = result["host_view"]["full_batch_decode_steps"]
    if host:  # what the device waits for: all but the work done while it runs the forward, and the wait itself
        result["critical_path_ms"] = sum(v for p, v in host.items() if p not in ("overlap", "sample"))
    return result


def sync_check(llm, vocab: int) -> dict:
    """CUDA: count synchronising calls (torch.cuda's sync debug mode) while steps are prepared and launched
    and while the sampler runs, for greedy and for sampled requests with top-p/top-k/min-p, a seed, penalties
    and min_tokens bans. Preparing and launching must make none (the copies are asynchronous, so the host
    keeps going while the device works); the sampler at most two (reading its token ids and log-probs)."""
    engine, runner = llm.engine, llm.engine.runner
    execute, sampler = runner.execute, engine.sampler
    per_call: dict[str, list[int]] = {"execute": [], "sampler": []}
    prompts = random_prompts(random.Random(2), [40, 70, 100, 130], vocab)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.7, top_k=20, repetition_penalty=1.2, presence_penalty=0.5,
                             frequency_penalty=0.3, min_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, min_p=0.05, ignore_eos=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def counting(name, fn):
            def wrapper(*args):
                before = len(caught)
                out = fn(*args)
                per_call[name].append(sum("synchroniz" in str(w.message) for w in caught[before:]))
                return out
            return wrapper
        runner.execute, engine.sampler = counting("execute", execute), counting("sampler", sampler)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            del runner.execute
            engine.sampler = sampler
    messages = sorted({str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)})
    return {"execute_syncs_per_call": per_call["execute"], "sampler_syncs_per_call": per_call["sampler"],
            "messages": messages[:5],
            "ok": bool(per_call["sampler"]) and max(per_call["execute"], default=0) == 0
            and max(per_call["sampler"]) <= 2}


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
def _public(value):
    """The report without per-step records (keys starting with _)."""
    if isinstance(value, dict):
        return {k: _public(v) for k, v in value.items() if not k.startswith("_")}
    return value


def write_report(out_dir: str, report: dict) -> dict:
    """Write gpu_bench-<device>.json and .md (per-step records left out); returns what was written."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"gpu_bench-{slug(report['device'])}")
    public = _public(report)
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
        lines += ["Throughput run (no step timer):", "",
                  "| output tok/s | output tokens | seconds | truncated |", "|---|---|---|---|",
                  f"| {t['output_tokens_per_s']:.0f} | {t['output_tokens']} | {t['seconds']:.1f} | "
                  f"{t['truncated_at_time_limit']} |", ""]
    b = r.get("breakdown")
    if b:
        lines += ["Breakdown run, ms per step (host view: no syncs, the device's work lands in `sample`, where the "
                  "sampler waits for it; device view: synced at each mark):", "",
                  "| view, steps | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
        for view in ("host_view", "device_view"):
            for sel in ("full_batch_decode_steps", "all_steps"):
                ms = b.get(view, {}).get(sel)
                if ms:
                    lines.append(f"| {view} {sel} | " + " | ".join(f"{ms[p]:.2f}" for p in PHASES) + " |")
        lines += ["", f"Host critical path per full-batch decode step (all but `overlap` and `sample`): "
                      f"{_fmt(b.get('critical_path_ms'), '.2f')} ms.", ""]
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
    sc = r.get("sync_check")
    if sc:
        lines.append(f"- sync check: {'ok' if sc['ok'] else 'FAILED'}; syncs per execute "
                     f"{sorted(set(sc['execute_syncs_per_call']))}, per sampler call "
                     f"{sorted(set(sc['sampler_syncs_per_call']))}")
    for c in r.get("checks", []):
        greedy = "equal" if c["greedy_equal"] else f"diverged {c['divergences']}"
        errors = ", ".join(format(e, ".2e") for e in c["logits_rel_err"])
        lines.append(f"- check `{c['name']}`: greedy {greedy}; logits rel err {errors} "
                     f"(tolerance {c['logits_tolerance']}: {'ok' if c['logits_ok'] else 'OVER'})")
    if r.get("errors"):
        lines += ["", "Errors:", *[f"- {e}" for e in r["errors"]]]
    return "\n".join(lines) + "\n"


# ---- main: the steps ------------------------------------------------------------------------------
@dataclass
class Bench:
    """What the steps share: the options, what they measure into (report), and the engines they make."""
    args: argparse.Namespace
    cuda: bool
    shape: Shape
    load: Load
    dtype: torch.dtype
    tolerance: float
    bandwidth: float | None
    report: dict
    model_dir: str = ""
    check_runs: dict | None = None
    llm: object = None
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def save(self) -> dict:
        return write_report(self.args.out, self.report)

    def attempt(self, what: str, fn, *args):
        """Run one step; a failure goes into the report (and fails the run) without stopping the others."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - report it and go on to the next step
            log.exception("%s failed", what)
            self.report["errors"].append(f"{what}: {type(e).__name__}: {e}")
            return None
        finally:
            self.save()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "perf", "results", "gpu_bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny model and load (CPU: Triton in the interpreter)")
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hbm-bandwidth", type=float,
                    help="B/s; default from the device name (H100 SXM 3.35e12, H200 4.8e12)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--time-limit", type=float, default=150.0,
                    help="seconds for the throughput run; requests still running then are aborted and it says so")
    ap.add_argument("--logits-tolerance", type=float,
                    help=f"relative L2 error allowed (default {BF16_LOGITS_TOLERANCE} bf16, 1e-4 fp32)")
    ap.add_argument("--skip-check", action="store_true", help="no Triton-vs-torch / graph-vs-eager checks")
    return ap.parse_args(argv)


def setup(argv=None) -> Bench:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cuda = torch.cuda.is_available()
    shape, load = (TINY, SMOKE) if args.smoke else (QWEN2_05B, FULL)
    if args.num_requests:
        load.num_requests = args.num_requests
    dtype = torch.bfloat16 if cuda else torch.float32  # what the engine's dtype=auto picks
    tolerance = args.logits_tolerance or (BF16_LOGITS_TOLERANCE if dtype == torch.bfloat16 else 1e-4)
    report = {"device": device_name() + ("-smoke" if args.smoke else ""), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "torch": torch.__version__, "smoke": args.smoke, "load": load.__dict__, "checks": [], "errors": [],
              "inherited_triton_interpret": INHERITED_INTERPRET}
    return Bench(args, cuda, shape, load, dtype, tolerance, args.hbm_bandwidth or default_bandwidth(device_name()),
                 report)


def write_bench_model(b: Bench) -> None:
    t = time.perf_counter()
    params = write_model(b.model_dir, b.shape, torch.device(b.device), b.dtype, b.args.seed)
    b.report["model"] = {"shape": b.shape.__dict__, "params": params, "dtype": str(b.dtype),
                         "write_s": time.perf_counter() - t}


def check_kernels(b: Bench) -> None:
    check, b.check_runs = kernel_check(b.model_dir, b.load, b.shape.vocab, b.device, b.tolerance)
    b.report["checks"].append(check)


def start_engine(b: Bench) -> None:
    t = time.perf_counter()
    load = b.load
    # Speculation off, as auto leaves it on CUDA: the CPU smoke then runs the steps the GPU run does.
    options = dict(device=b.device, max_num_seqs=load.max_num_seqs, max_model_len=load.max_model_len,
                   max_num_batched_tokens=load.max_num_batched_tokens,
                   gpu_memory_utilization=b.args.gpu_memory_utilization, speculative_method="off")
    # The CPU pool is a byte budget, and a GPU fraction would be millions of tiny-model blocks: size
    # both to the load instead.
    if not b.cuda or b.args.smoke:
        options["num_kv_blocks"] = 4 * load.max_num_seqs * load.max_model_len // 16
    b.llm = LLM(b.model_dir, **options)
    runner = b.llm.engine.runner
    if not b.cuda:  # no graphs to capture: still run the padded static-buffer decode they replay
        runner.enable_static_decode(capture=False)
    static = runner.static_decode
    b.report["engine"] = {
        "init_s": time.perf_counter() - t, "num_kv_blocks": runner.num_blocks,
        "kv_cache_gib": runner.num_blocks * runner.bytes_per_block() / 2**30,
        "graph_buckets": sorted(static.graphs) if static else [], "fused_ops": runner.forward is not runner.model,
        "options": options}


def run_throughput(b: Bench) -> None:
    b.report["throughput"] = throughput(b.llm, b.load, b.shape.vocab, b.args.seed, b.args.time_limit)


def run_breakdown(b: Bench) -> None:
    b.report["breakdown"] = result = breakdown(b.llm, b.load, b.shape.vocab, b.args.seed, b.args.time_limit)
    runner = b.llm.engine.runner
    mc = runner.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # tied: counted once
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
    b.report["roofline"] = roofline(result["device_view"], weight_bytes, kv_per_token, b.bandwidth,
                                    b.load.max_num_seqs)


def run_sync_check(b: Bench) -> None:
    b.report["sync_check"] = result = sync_check(b.llm, b.shape.vocab)
    if not result["ok"]:
        b.report["errors"].append(f"sync check: a step synchronised outside the sampler's reads: {result}")


def check_graphs(b: Bench) -> None:
    """The check prompts through the benchmark engine, whose decodes replay CUDA graphs (on CPU: the padded
    static-buffer path, eagerly), against the eager run with the same attention backend."""
    backend = "triton" if b.cuda else "torch"
    prompts = random_prompts(random.Random(1), b.load.check_prompt_lens, b.shape.vocab)
    ids, logits = greedy_run(b.llm, prompts, b.load.check_tokens, backend)
    b.report["checks"].append(compare("static_decode_vs_eager", ids, logits, *b.check_runs[backend], b.tolerance))


def main(argv=None) -> int:
    b = setup(argv)
    with tempfile.TemporaryDirectory(prefix="gpu_bench_model_") as b.model_dir:
        b.attempt("model", write_bench_model, b)
        if not b.args.skip_check:
            b.attempt("kernel check", check_kernels, b)
        b.attempt("engine start", start_engine, b)
        if b.llm is None:
            print(markdown(b.save()))
            return 1
        b.attempt("throughput run", run_throughput, b)
        b.attempt("breakdown run", run_breakdown, b)
        if b.cuda:
            b.attempt("sync check", run_sync_check, b)
        if b.check_runs is not None:
            b.attempt("graph check", check_graphs, b)
        b.report["total_s"] = time.perf_counter() - b.t_start
        public = b.save()
        free_engine(b.llm)
    print(markdown(public))
    failed = b.report["errors"] or any(not c["logits_ok"] for c in b.report["checks"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
