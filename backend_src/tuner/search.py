"""Choose engine options for an SLA: simulate a grid at the trace's rate, then race the configs that meet the
SLA to higher rates, shrink the KV pool of the winner, and probe its neighbours (why it wins).

At a fixed offered rate every config that keeps up delivers the same tokens/s (the offered load), so
"highest throughput under the SLA" is decided by how far the rate can rise before the SLA breaks: the
winner is the config that sustains the highest rate (ties: smaller KV pool, then lower p99 TTFT).
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from tuner.sim import SimRequest, meets, simulate

MiB = 1 << 20
DEFAULT_GRID = {
    "max_num_seqs": [4, 8, 16, 32, 64],
    "max_num_batched_tokens": [64, 128, 256, 512, 1024],
    "fast_lane_share": [0.0, 0.25, 0.5],
    "block_size": [16, 32],
}
KV_POOLS_MIB = [32, 64, 128, 256, 512, 1024]  # tried smallest-first for the winner (stage 3)
RATE_STEP = 1.25  # rate multiplier per step when one config climbs to its limit
RATE_PRECISION = 0.02  # bisection stops when the bracket is this tight (relative)
MAX_SCALE = 16.0  # a config still meeting the SLA at 16x the trace's rate is reported as ">= 16x" (the trace is
MIN_SCALE = 1 / 64  # too short to load it); below 1/64 of the rate the SLA is called unreachable

# The worker processes' shared inputs (set before the pool forks; read-only afterwards).
_STATE: dict = {}


@dataclass
class Evaluated:
    options: dict
    rate_scale: float
    figures: dict
    stopped: str = ""  # why the simulation stopped early (the SLA could no longer hold), or ""
    ok: bool = False  # ran to the end and met the SLA


@dataclass
class SearchResult:
    grid: list[Evaluated]  # every config at the trace's rate
    chosen: dict
    chosen_at_rate: Evaluated
    max_rate_scale: float
    max_rate_eval: Evaluated | None
    default: Evaluated
    default_max_rate_scale: float
    kv_steps: list[Evaluated] = field(default_factory=list)
    neighbours: list[tuple[str, object, Evaluated]] = field(default_factory=list)
    num_simulations: int = 0
    seconds: float = 0.0
    grid_seconds: float = 0.0
    sla_met: bool = True


def _run(task: tuple[dict, float, bool]) -> Evaluated:
    options, scale, early = task
    st = _STATE
    cost = st["costs"][int(options["threads"])]
    res = simulate(st["requests"], options, cost, st["kv_bytes_per_token"], rate_scale=scale,
                   sla=st["sla"] if early else None)
    return Evaluated(options, scale, res.figures, res.stopped_early,
                     not res.stopped_early and meets(res.figures, st["sla"]))


class Searcher:
    def __init__(self, requests: list[SimRequest], cost_model, sla: dict, base_options: dict, workers: int,
                 progress: Callable[[str], None] = print):
        _STATE.update(requests=requests, sla=sla, kv_bytes_per_token=cost_model.kv_bytes_per_token,
                      costs={t: cost_model.step_seconds(t) for t in cost_model.threads})
        self.sla = sla
        self.base = base_options
        self.threads = cost_model.threads
        self.progress = progress
        self.num_sims = 0
        self.pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()

    def evaluate(self, configs: list[dict], scale: float | list[float], early: bool, label: str) -> list[Evaluated]:
        """Simulate configs (each at its own rate multiplier when scale is a list), in parallel."""
        scales = scale if isinstance(scale, list) else [scale] * len(configs)
        tasks = [(c, x, early) for c, x in zip(configs, scales)]
        self.num_sims += len(tasks)
        mapper = self.pool.imap if self.pool is not None else map
        out = []
        t0 = time.perf_counter()
        for k, ev in enumerate(mapper(_run, tasks), 1):
            out.append(ev)
            if k == len(tasks) or k % 50 == 0:
                self.progress(f"[search] {label}: {k}/{len(tasks)} simulations ({time.perf_counter() - t0:.1f} s)")
        return out

    # ---- stages ---------------------------------------------------------------------------------
    def grid_configs(self, grid: dict) -> list[dict]:
        grid = {"threads": self.threads, **grid}
        names = list(grid)
        return [{**self.base, **dict(zip(names, values))} for values in itertools.product(*(grid[n] for n in names))]

    def race(self, survivors: list[Evaluated], scale: float, factor: float, limit: float
             ) -> tuple[list[Evaluated], float, float]:
        """Raise the rate by `factor` while any config keeps the SLA (up to `limit`); a config that fails at a
        level cannot beat one that passes it, so it drops out. Returns the last level's survivors, their rate
        multiplier, and the first multiplier where none survived (== the multiplier if `limit` was reached)."""
        while scale < limit:
            nxt = min(scale * factor, limit)
            evals = self.evaluate([s.options for s in survivors], nxt, True, f"race at rate x{nxt:.2f}")
            passed = [e for e in evals if e.ok]
            if not passed:
                return survivors, scale, nxt
            survivors, scale = passed, nxt
        return survivors, scale, scale

    def bisect(self, configs: list[dict], lo: list[float], hi: list[float]) -> list[tuple[float, Evaluated | None]]:
        """For each config, the highest multiplier in [lo, hi) that keeps the SLA, given lo passes and hi fails
        (to RATE_PRECISION); all configs' midpoints are simulated together, in parallel."""
        lo, hi = list(lo), list(hi)
        best: list[Evaluated | None] = [None] * len(configs)
        while True:
            todo = [i for i in range(len(configs)) if hi[i] / lo[i] - 1 > RATE_PRECISION]
            if not todo:
                return list(zip(lo, best))
            mids = [(lo[i] * hi[i]) ** 0.5 for i in todo]
            evals = self.evaluate([configs[i] for i in todo], mids, True, f"bisecting {len(todo)} rate limit(s)")
            for i, mid, ev in zip(todo, mids, evals):
                if ev.ok:
                    lo[i], best[i] = mid, ev
                else:
                    hi[i] = mid

    def max_rate(self, options: dict, first: Evaluated, start: float = 1.0) -> tuple[float, Evaluated | None]:
        """Highest sustainable multiplier of one config (0 if none down to MIN_SCALE), from its evaluation
        `first` at multiplier `start`."""
        if first.ok:
            lo = start
            while lo < MAX_SCALE:
                hi = min(lo * RATE_STEP, MAX_SCALE)
                ev = self.evaluate([options], hi, True, f"climb x{hi:.2f}")[0]
                if not ev.ok:
                    scale, best = self.bisect([options], [lo], [hi])[0]
                    return scale, best or first
                lo, first = hi, ev
            return lo, first
        hi = start
        while hi > MIN_SCALE:
            lo = hi / RATE_STEP
            ev = self.evaluate([options], lo, True, f"descend x{lo:.3f}")[0]
            if ev.ok:
                scale, best = self.bisect([options], [lo], [hi])[0]
                return scale, best or ev
            hi = lo
        return 0.0, None


PRIMARY = ("threads", "max_num_seqs", "max_num_batched_tokens")


def _primary(options: dict) -> tuple:
    return tuple(options.get(k) for k in PRIMARY)


def _representatives(evals: list[Evaluated]) -> list[Evaluated]:
    """Per capacity-knob combination, the variant whose p99s sit furthest under the SLA."""
    sla = _STATE["sla"]
    best: dict[tuple, tuple[float, Evaluated]] = {}
    for e in evals:
        slack = max(e.figures["ttft_p99_ms"] / sla["ttft_p99_ms"], e.figures["itl_p99_ms"] / sla["itl_p99_ms"])
        key = _primary(e.options)
        if key not in best or slack < best[key][0]:
            best[key] = (slack, e)
    return [e for _, e in best.values()]


def _rank_key(ev: Evaluated, scale: float) -> tuple:
    # Higher sustained rate first (in steps of the bisection precision), then less KV memory, then TTFT.
    return (-round(scale / RATE_PRECISION), ev.figures["kv_blocks"] * ev.options["block_size"],
            ev.figures["ttft_p99_ms"])


def search(requests: list[SimRequest], cost_model, sla: dict, grid: dict, default_options: dict,
           base_options: dict, workers: int = 0, kv_pools_mib: list[int] | None = None,
           progress: Callable[[str], None] = print) -> SearchResult:
    t_start = time.perf_counter()
    workers = workers or os.cpu_count() or 1
    s = Searcher(requests, cost_model, sla, base_options, workers, progress)
    try:
        # 1. The grid at the trace's rate, simulated to the end (the Pareto front needs every figure).
        configs = s.grid_configs(grid)
        if default_options not in configs:
            configs.append(dict(default_options))  # the default is a candidate too: it may be the best
        evals = s.evaluate(configs, 1.0, False, "grid at the trace's rate")
        grid_seconds = time.perf_counter() - t_start
        default_eval = next(e for e in evals if e.options == default_options)
        feasible = [e for e in evals if e.ok]
        sla_met = bool(feasible)
        # 2. Race the feasible configs to higher rates; bisect the last survivors' limits.
        if feasible:
            # Only the capacity knobs race: per (threads, max_num_seqs, max_num_batched_tokens) the variant with
            # the most room under the SLA at the trace's rate; the other options are settled after (step 2b).
            reps = _representatives(feasible)
            # Doubling first (most configs drop out early), then quarter-octave steps inside the last octave.
            survivors, lo, hi = s.race(reps, 1.0, 2.0, MAX_SCALE)
            if hi > lo:
                first_fail = hi  # known to fail for all: the fine race stops one step below it
                survivors, lo, hi = s.race(survivors, lo, 2 ** 0.25, first_fail / 2 ** 0.25 * (1 + 1e-9))
                if hi == lo:
                    hi = first_fail
            progress(f"[search] {len(feasible)} configs meet the SLA at the trace's rate ({len(reps)} raced); "
                     f"{len(survivors)} still at x{lo:.2f}, none at x{hi:.2f}; bisecting those")
            if hi > lo:
                found = s.bisect([sv.options for sv in survivors], [lo] * len(survivors), [hi] * len(survivors))
            else:
                found = [(lo, sv) for sv in survivors]
            limits = [(scale, ev or sv) for (scale, ev), sv in zip(found, survivors)]
            best_scale, best_ev = min(limits, key=lambda x: _rank_key(x[1], x[0]))
            # 2b. The winner's siblings (other fast_lane_share / block_size): does one hold a higher rate?
            siblings = [e for e in feasible if _primary(e.options) == _primary(best_ev.options)
                        and e.options != best_ev.options] if best_scale < MAX_SCALE else []
            step_up = min(best_scale * (1 + 2 * RATE_PRECISION), MAX_SCALE)
            tries = s.evaluate([e.options for e in siblings], step_up, True, "the winner's siblings")
            for ev in (e for e in tries if e.ok):
                scale, top = s.max_rate(ev.options, ev, start=step_up)
                if _rank_key(top or ev, scale) < _rank_key(best_ev, best_scale):
                    best_scale, best_ev = scale, top or ev
        else:
            # Nothing meets it: take the config closest to it, and say how far the rate must fall.
            closest = min(evals, key=lambda e: max(e.figures["ttft_p99_ms"] / sla["ttft_p99_ms"],
                                                   e.figures["itl_p99_ms"] / sla["itl_p99_ms"]))
            best_scale, best_ev = s.max_rate(closest.options, closest)
            best_ev = best_ev or closest
        chosen = dict(best_ev.options)
        # 3. The smallest KV pool that keeps the winner's rate (memory is what an operator pays for).
        pools = [m * MiB for m in sorted(kv_pools_mib or KV_POOLS_MIB)
                 if m * MiB < int(chosen.get("kv_cache_memory_bytes", 0))] if best_scale else []
        kv_steps = s.evaluate([{**chosen, "kv_cache_memory_bytes": b} for b in pools], best_scale, True, "KV pools")
        smallest = next((ev for ev in kv_steps if ev.ok), None)
        if smallest is not None:
            chosen = dict(smallest.options)
        at_rate, max_eval = (s.evaluate([chosen, chosen], [1.0, best_scale], False, "chosen")
                             if best_scale else (s.evaluate([chosen], 1.0, False, "chosen")[0], None))
        default_scale, _ = s.max_rate(default_options, default_eval)
        # 4. Neighbours: each option moved one grid step, at the chosen config's highest rate.
        probe_scale = best_scale or 1.0
        moves = []
        for name, values in {"threads": s.threads, **grid}.items():
            if chosen.get(name) in values:
                k = values.index(chosen[name])
                moves += [(name, values[j]) for j in (k - 1, k + 1) if 0 <= j < len(values)]
        probes = s.evaluate([{**chosen, n: v} for n, v in moves], probe_scale, False, "neighbours")
        neighbours = [(n, v, ev) for (n, v), ev in zip(moves, probes)]
        return SearchResult(evals, chosen, at_rate, best_scale, max_eval, default_eval, default_scale, kv_steps,
                            neighbours, s.num_sims, time.perf_counter() - t_start, grid_seconds, sla_met)
    finally:
        s.close()


def pareto(points: list[tuple[float, float]], tie: float = 0.005) -> list[int]:
    """Indices of the points no other beats on both (higher first value, lower second), by first value. First
    values within `tie` (relative) of each other count as equal: 39.67 and 39.66 tokens/s are the same load."""
    def bucket(v: float) -> int:
        return round(math.log(v) / math.log1p(tie)) if v > 0 else -(1 << 30)

    order = sorted(range(len(points)), key=lambda i: (-bucket(points[i][0]), points[i][1]))
    front, best_second = [], float("inf")
    for i in order:
        if points[i][1] < best_second:
            front.append(i)
            best_second = points[i][1]
    return front
