"""Host time per engine step with the model forward replaced by a null one, at 64-256 running requests.

At the GPU target (0.5B Qwen2 shape, 256 running, >= 17.7k output tokens/s) a whole step has about 14 ms,
so every millisecond of Python per step costs about 7% of throughput. This measures that Python on this CPU:
the real engine (scheduler, block manager with prefix caching, the static-buffer decode preparation that CUDA
graphs replay, sampler, incremental detokenizer with the SmolLM2 tokenizer, stop checks, metrics) runs decode
steps whose forward returns pre-drawn random logits of the vocabulary's size, so sampling and detokenizing see
realistic token ids. Prompts of 100-1000 tokens are prefilled (and left in the prefix cache) before timing.

    .venv/bin/python -m perf.bench.host_overhead                          # 64, 128, 256 running; a minute or two
    .venv/bin/python -m perf.bench.host_overhead --running 8 --steps 3 --sampled-steps 2   # smoke

Phases, in ms per step: schedule, prepare (batch to tensors), forward (the null forward: ~0), advance (the
scheduler's after-forward bookkeeping: prefix-cache registration), sample, detokenize (with stop checks and
per-token metrics), other (step metrics and gauges). Each figure is a median over the timed steps of the engine
thread's CPU time, so another process taking the core mid-step does not count.

The sampler's torch ops (argmax, softmax, sort, noise, penalty masks over [rows, vocab]) are kernels on a GPU,
queued behind the forward; on this CPU they run inline and take tens to hundreds of milliseconds at 256 rows.
Each is timed (a TorchDispatchMode around the sampler) and its time reported apart as `sampler_ops`, with
LAUNCH_S per op left in `sample` for its kernel launch. What `sample` shows is the host's share: Python,
building inputs and their copies, one launch per op.

`critical_ms` is the host time the device waits for: every phase but those the engine overlaps with device
work (listed in the report). `total_ms` is all host time. With --json FILE, greedy_ms_per_step and
sampled_ms_per_step are the critical-path figures at the largest --running; the rest is beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inflight.config import EngineConfig
from inflight.engine import LLMEngine
from inflight.sequence import SamplingParams
from inflight.step_timer import StepTimer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# tiny-llama carries SmolLM2's tokenizer (vocab 49152); its weights never run here.
DEFAULT_MODEL = os.path.join(ROOT, "models", "tiny-llama")
PHASES = ("schedule", "prepare", "forward", "advance", "overlap", "mask", "sample", "detokenize", "other")
# Host work that runs while the device is busy, so the step does not wait for it. On CUDA a step launches the
# forward (a graph replay) and returns without a sync; the scheduler's bookkeeping (advance), the text of last
# step's tokens (overlap: LLMEngine._render_deferred), the structured-output bitmask (mask: filled on the host,
# copied and applied by a kernel; perf/bench/structured.py measures it) and the sampler's host work (building
# its inputs, one asynchronous copy, launching its kernels) then run while the forward does, until the sampler
# reads its tokens. That holds while nothing before that read syncs (tests/unit/test_sampler.py checks the
# sampler's one copy; perf/gpu/bench.py's sync check counts syncs on the GPU) and the work is shorter than the
# forward (~10 ms at the target). Everything else, before the launch and after the read, the device waits for.
OVERLAPPED: tuple[str, ...] = ("advance", "overlap", "mask", "sample")
# The engine thread's CPU time, not wall time: on a shared machine the thread is often descheduled, and wall
# time would charge that to whatever phase was running. All timed work here runs on that one thread.
clock = time.thread_time
FILL_STEPS_MAX = 32
LAUNCH_S = 5e-6  # host time of one eager PyTorch op on CUDA (dispatch + cudaLaunchKernel), a round figure


class HostTimer(StepTimer):
    """StepTimer that can move time out of the lap in progress into a phase of its own (carve)."""

    def __init__(self):
        super().__init__(sync=False, keep_steps=True)
        self._now = clock
        self.totals.update({"advance": 0.0, "sampler_ops": 0.0})

    def carve(self, phase: str, seconds: float) -> None:
        self._current[phase] = self._current.get(phase, 0.0) + seconds
        self._t += seconds  # the lap in progress started that much later


class OpTimer(TorchDispatchMode):
    """Counts the torch ops run while it is active and the time spent inside them, and keeps their large
    outputs alive until release(): freeing a [rows, vocab] tensor hands its pages back to the OS, which takes
    the CPU milliseconds, in whatever Python line drops it; the CUDA caching allocator keeps them instead."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self.count = 0
        self._keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = clock()
        out = func(*args, **(kwargs or {}))
        self.seconds += clock() - t0
        self.count += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.nbytes >= 1 << 20:
                self._keep.append(t)
        return out

    def release(self) -> float:
        """Free the kept outputs; returns the seconds that took."""
        t0 = clock()
        self._keep.clear()
        return clock() - t0


def op_timer_overhead(n: int = 5000) -> float:
    """Seconds OpTimer itself adds to each op, outside the op (measured on a tiny one)."""
    x = torch.zeros(4, 8)

    def loop() -> float:
        t0 = clock()
        for _ in range(n):
            x.argmax(-1)
        return clock() - t0

    loop()
    plain = min(loop() for _ in range(3))
    with OpTimer() as ops:
        loop()  # the first ops under a dispatch mode are slow (its dispatch caches fill)
        timed = min(loop() for _ in range(3))
    inside = ops.seconds / ops.count
    return max(0.0, (timed - plain) / n - (inside - plain / n))


class MeasuredSampler:
    """Wraps the engine's sampler. On a GPU its torch ops are kernels queued on the device, and the host pays
    a launch for each; here they run inline, so their time moves to the timer's `sampler_ops` phase and
    LAUNCH_S per op stays in `sample`."""

    def __init__(self, sampler, timer: HostTimer, mode_overhead_s: float):
        self.sampler, self.timer, self.mode_overhead_s = sampler, timer, mode_overhead_s
        self.num_ops = 0

    def __call__(self, logits, seqs, eos_token_ids):
        with OpTimer() as ops:
            out = self.sampler(logits, seqs, eos_token_ids)
        self.timer.carve("sampler_ops", ops.release() + ops.seconds + ops.count * (self.mode_overhead_s - LAUNCH_S))
        self.num_ops += ops.count
        return out


def null_forward(engine: LLMEngine, vocab: int, max_rows: int, seed: int) -> None:
    """Replace the model: hidden states of width 1, and logits sliced from a pre-drawn random pool."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(max_rows + 251, vocab, generator=gen) * 4.0  # peaked enough that top-p cuts
    offset = [0]

    def forward(ids, positions, meta, kv_caches):
        return torch.zeros(ids.shape[0], 1)

    def compute_logits(hidden):
        offset[0] = (offset[0] + 97) % 251  # a different slice each step: different tokens
        return pool[offset[0]:offset[0] + hidden.shape[0]]

    runner = engine.runner
    runner.forward = forward
    runner.model.compute_logits = compute_logits
    runner.enable_static_decode(capture=False)  # decode steps go through the buffers CUDA graphs replay


def build_engine(model: str, max_running: int, max_prompt: int, max_steps: int, seed: int,
                 logits_width: int | None = None, defer_detokenize: bool = True) -> LLMEngine:
    blocks_per_seq = (max_prompt + max_steps + 16) // 16 + 1
    config = EngineConfig.from_options(
        model=model, max_num_seqs=max_running, max_num_batched_tokens=16384, max_model_len=2048,
        block_size=16, num_kv_blocks=max_running * blocks_per_seq + 64, seed=seed)
    engine = LLMEngine(config)
    null_forward(engine, logits_width or engine.runner.model_config.vocab_size, max_running, seed)
    engine.defer_detokenize = defer_detokenize  # as on CUDA, where the forward runs while the host renders text
    return engine


MODES = ("greedy", "sampled", "stop")


def request_params(mode: str, i: int, max_tokens: int) -> SamplingParams:
    """greedy; sampled: top-p, penalties, a seed on every other request; stop: greedy with a stop string,
    whose text must be rendered and searched in the step that makes each token."""
    if mode == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if mode == "stop":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n\nUser:"], ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.3, seed=i if i % 2 == 0 else None,
                          ignore_eos=True)


def run_config(engine: LLMEngine, prompts: list[list[int]], mode: str, warmup: int, steps: int,
               mode_overhead_s: float) -> dict:
    """Admit the requests, prefill them (untimed), then time `steps` decode steps after `warmup` ones."""
    # Nobody finishes while timed, so the running count stays put (the first admitted decode while the last
    # ones prefill: up to ~10 steps at 256 prompts of 16384-token chunks).
    max_tokens = warmup + steps + FILL_STEPS_MAX
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{mode}-{len(prompts)}-{i}", prompt, request_params(mode, i, max_tokens))
    while any(s.num_output_tokens == 0 for s in engine.seqs.values()):
        engine.step()
    sampler, advance = engine.sampler, engine.scheduler.advance
    timer = HostTimer()
    measured = MeasuredSampler(sampler, timer, mode_overhead_s)

    def timed_advance(scheduled):
        t0 = clock()
        advance(scheduled)
        measured.timer.carve("advance", clock() - t0)
    engine.sampler, engine.scheduler.advance = measured, timed_advance
    engine.set_step_timer(timer)
    try:
        for i in range(warmup + steps):
            if i == warmup:  # what the warm-up steps recorded is dropped
                timer = measured.timer = HostTimer()
                measured.num_ops = 0
                engine.set_step_timer(timer)
            assert len(engine.step()) == len(prompts), "a request finished or stalled while timed"
    finally:
        engine.sampler = sampler
        del engine.scheduler.advance
        engine.set_step_timer(None)
    for rid in list(engine.seqs):  # their blocks stay in the prefix cache for the next configuration
        engine.abort_request(rid)
    # Medians over the steps: another process taking the core mid-step inflates one step, not the figure.
    per_step = [{p: 1000 * lap.get(p, 0.0) for p in (*PHASES, "sampler_ops")} for lap in timer.steps]
    ms = {p: statistics.median(step[p] for step in per_step) for p in (*PHASES, "sampler_ops")}
    return {"running": len(prompts), "mode": mode, "steps": steps, "ms_per_step": ms,
            "total_ms": statistics.median(sum(step[p] for p in PHASES) for step in per_step),
            "critical_ms": statistics.median(sum(step[p] for p in PHASES if p not in OVERLAPPED)
                                             for step in per_step),
            "sampler_ops_per_step": measured.num_ops / steps}


def table(results: list[dict]) -> str:
    cols = (*PHASES, "critical_ms", "total_ms", "sampler_ops", "ops")
    lines = ["| mode | running | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in results:
        vals = [r["ms_per_step"][p] for p in PHASES] + [r["critical_ms"], r["total_ms"],
                                                        r["ms_per_step"]["sampler_ops"]]
        lines.append(f"| {r['mode']} | {r['running']} | " + " | ".join(f"{v:.3f}" for v in vals)
                     + f" | {r['sampler_ops_per_step']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="folder with the tokenizer and config (weights unused)")
    ap.add_argument("--running", default="64,128,256", help="comma-separated running-request counts")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per greedy configuration")
    ap.add_argument("--sampled-steps", type=int, default=8,
                    help="timed steps per sampled configuration (its [rows, vocab] ops are slow on a CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logits-width", type=int,
                    help="logits of this many token ids (the lowest ids: in a BPE vocabulary the most frequent "
                         "ones) instead of the whole vocabulary; prompt and output ids stay below it. Shows which "
                         "host costs follow the size of the [rows, vocab] tensors on this CPU")
    ap.add_argument("--no-defer", action="store_true",
                    help="render every token's text in its own step (the CPU engine's way) instead of the next one")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    # One thread: the ops timed apart do not need more, and OpenMP barriers stall on a shared 2-core machine.
    torch.set_num_threads(1)
    mode_overhead_s = op_timer_overhead()

    running = sorted(int(n) for n in args.running.split(","))
    modes = args.modes.split(",")
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    engine = build_engine(args.model, running[-1], 1000,
                          args.warmup + max(args.steps, args.sampled_steps) + FILL_STEPS_MAX, args.seed,
                          args.logits_width, not args.no_defer)
    vocab = args.logits_width or engine.runner.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1000))] for _ in range(running[-1])]
    results = []
    for mode in modes:
        for n in running:
            steps = args.sampled_steps if mode == "sampled" else args.steps
            results.append(run_config(engine, prompts[:n], mode, args.warmup, steps, mode_overhead_s))
            r = results[-1]
            print(f"{mode:8s} running {n:4d}: critical {r['critical_ms']:.3f} ms/step, total {r['total_ms']:.3f}, "
                  f"sampler ops {r['ms_per_step']['sampler_ops']:.1f} ms", file=sys.stderr)
    report = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg(),
              "logits_width": vocab, "overlapped_phases": list(OVERLAPPED), "launch_s": LAUNCH_S,
              "op_timer_overhead_s": mode_overhead_s,
              "seconds": time.perf_counter() - t_start, "results": results}
    largest = {r["mode"]: r["critical_ms"] for r in results if r["running"] == running[-1]}
    report.update({f"{mode}_ms_per_step": largest.get(mode) for mode in MODES})
    print(table(results))
    print(f"\nload average {report['load_average']}, {report['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
