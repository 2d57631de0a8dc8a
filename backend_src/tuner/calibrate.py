"""Time real engine steps of chosen shapes (decode rows x context, prefill chunk x context) on this host.

Each shape is built through the engine's own API, so every step is a real `LLMEngine.step()` (schedule,
forward, sampler, detokenizer): decode rows share a cached prefix of the wanted context (prefix caching makes
building them cheap), a prefill chunk is a fresh request whose first part hits a cached prefix (its context)
and whose remaining tokens are computed in that step. Steps are timed as a whole; the features come from what
the scheduler actually scheduled in that step.
"""
from __future__ import annotations

import random
import time
from typing import Callable

from tuner.cost import step_features

# (decode rows, decode contexts) x (prefill chunk, chunk context, number of chunks). A context list with two
# values gives half the rows each (what separates sum(context) from rows x longest).
# Sized for a CPU where a prefill token costs ~5-8 ms (SmolLM2 fp32): about 4 minutes per thread count.
FULL_GRID = {
    "decodes": [(0, [0]), (1, [64]), (4, [64]), (16, [64]), (32, [64]), (64, [64]), (4, [512]), (16, [512]),
                (32, [512]), (64, [512]), (8, [1024]), (24, [1024]), (48, [1024]), (16, [2048]), (16, [64, 1024])],
    "prefills": [(0, 0, 0), (16, 0, 1), (64, 0, 1), (128, 0, 1), (64, 512, 1), (16, 0, 4)],
    "pure_prefills": [(256, 0, 1), (256, 512, 1), (32, 1024, 1)],
}
QUICK_GRID = {
    "decodes": [(0, [0]), (1, [64]), (8, [64]), (32, [64]), (8, [512]), (8, [64, 512])],
    "prefills": [(0, 0, 0), (16, 0, 1), (64, 0, 1), (32, 256, 1), (16, 0, 3)],
    "pure_prefills": [(128, 0, 1)],
}


CONTENDED = 0.85  # a step whose CPU time is below this share of threads x wall time was slowed by others
RETRIES = 3  # measure a contended shape again up to this many times (keeping the fastest)
RETRY_WAIT_S = 20


class _Recorder:
    """Wraps scheduler.schedule to keep the features of what it scheduled."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.original = scheduler.schedule
        self.last = None
        scheduler.schedule = self

    def __call__(self, members=None):
        out = self.original(members)
        self.last = step_features(out.scheduled)
        return out


def calibrate(model: str, grid: dict, reps: int, clock: str = "wall", retries: int = RETRIES,
              progress: Callable[[str], None] = print) -> list[dict]:
    """Timed points: each shape's fastest of `reps` steps (after one warm-up step), by wall clock, or by the
    process's CPU time (clock="cpu": what a step costs on a core of its own; meaningful for one thread only,
    and the way to calibrate on a machine shared with other work)."""
    from inflight import EngineConfig, SamplingParams
    from inflight.engine import LLMEngine

    max_rows = max(d for d, _ in grid["decodes"])
    max_ctx = max(max(c) for _, c in grid["decodes"])
    max_chunk = max(p + pc for p, pc, _ in grid["prefills"] + grid["pure_prefills"])
    block = 16
    # Shared prefixes + each row's own tail (a block, plus the tokens decoded while timing) + prefill chunks.
    blocks = (max_ctx + 2 * max_chunk) // block + max_rows * (3 + (reps * 12 + 40) // block) + 64
    import torch

    threads = torch.get_num_threads()
    # No drafts: each timed step must have exactly the shape asked for (the simulator replays no speculation).
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=max_rows + 16, max_num_batched_tokens=8192,
                                    max_model_len=4096, num_kv_blocks=blocks, block_size=block,
                                    speculative_method="off"))
    vocab = engine.runner.model_config.vocab_size
    eos = engine.eos_token_ids
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [t for t in (rng.randrange(100, vocab) for _ in range(n * 2)) if t not in eos][:n]

    recorder = _Recorder(engine.scheduler)
    greedy = dict(temperature=0.0, ignore_eos=True)
    ids = iter(range(1 << 30))
    prefixes: dict[int, list[int]] = {}

    def cached_prefix(n: int) -> list[int]:
        """A prompt prefix of n tokens whose blocks are in the prefix cache (computed once)."""
        if n not in prefixes:
            prefixes[n] = fresh(n)
            if n:
                engine.add_request(f"warm{next(ids)}", prefixes[n] + fresh(1), SamplingParams(max_tokens=1, **greedy))
                run_until_idle_of_waiting()
        return prefixes[n]

    def run_until_idle_of_waiting():
        while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
            engine.step()

    def timed_step() -> tuple[float, float, tuple]:
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3, recorder.last

    points = []
    total = len(grid["decodes"]) * len(grid["prefills"]) + len(grid["pure_prefills"])
    done = 0
    t_start = time.perf_counter()
    for rows, contexts in grid["decodes"]:
        # The decode rows: a cached prefix of each context, then a private block, then decoding.
        live = []
        for i in range(rows):
            ctx = contexts[i * len(contexts) // rows]
            prefix = cached_prefix(ctx - block) if ctx > block else []
            rid = f"row{next(ids)}"
            engine.add_request(rid, prefix + fresh(ctx - len(prefix)), SamplingParams(max_tokens=1000, **greedy))
            live.append(rid)
        run_until_idle_of_waiting()
        shapes = grid["prefills"] if rows else [s for s in grid["prefills"] if s[2]] + grid["pure_prefills"]
        for chunk, chunk_ctx, num_chunks in shapes:
            samples = []
            for attempt in range(1 + retries):
                for rep in range(reps + 1):  # the first of each shape is a warm-up (new matmul sizes)
                    prefix = cached_prefix(chunk_ctx)
                    for _ in range(num_chunks):
                        engine.add_request(f"pf{next(ids)}", prefix + fresh(chunk),
                                           SamplingParams(max_tokens=1, **greedy))
                    wall_ms, cpu_ms, features = timed_step()
                    run_until_idle_of_waiting()  # a chunk the budget did not take whole (never, with 8192)
                    if rep:
                        samples.append((wall_ms, cpu_ms, features))
                # The fastest of the repeats: other work on a shared machine only ever adds time to a step.
                k = min(range(len(samples)), key=lambda i: samples[i][0] if clock == "wall" else samples[i][1])
                wall_ms, cpu_ms, features = samples[k]
                if clock == "cpu" or cpu_ms >= CONTENDED * threads * wall_ms or attempt == retries:
                    break
                # Our threads did not get the CPU for that step: someone else's work. Wait, measure again.
                progress(f"[calibrate] contended (cpu/wall {cpu_ms / wall_ms:.2f} with {threads} thread(s)): "
                         f"waiting {RETRY_WAIT_S} s to measure again")
                time.sleep(RETRY_WAIT_S)
            points.append({"rows": rows, "contexts": contexts, "chunk": chunk, "chunk_ctx": chunk_ctx,
                           "chunks": num_chunks, "step_ms": wall_ms if clock == "wall" else cpu_ms,
                           "wall_ms": [round(s[0], 3) for s in samples], "cpu_ms": [round(s[1], 3) for s in samples],
                           "features": list(features)})
            done += 1
            progress(f"[calibrate] {done}/{total} rows={rows} ctx={contexts} chunk={chunk}x{num_chunks} "
                     f"at ctx {chunk_ctx}: {points[-1]['step_ms']:.1f} ms ({clock}; cpu/wall "
                     f"{cpu_ms / wall_ms:.2f}; {time.perf_counter() - t_start:.0f} s)")
        for rid in live:
            engine.abort_request(rid)
    assert engine.block_manager.is_whole(), "calibration leaked KV blocks"
    return points
