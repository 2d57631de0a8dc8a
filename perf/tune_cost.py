"""The step-cost model: how long one engine step takes on this host, from what the scheduler put in it.

Form (one coefficient set per torch thread count, all >= 0, fitted by non-negative least squares):

    t = c_step + c_token * tokens + c_sample * sampled_rows + c_chunk * prefill_chunks
        + c_prefill_attn * sum(chunk_len * context_len) / 1e3
        + c_decode_ctx * sum(decode context) / 1e3 + c_decode_pad * decode_rows * longest_decode_context / 1e3

Why these terms: the linears cost per token; the lm_head, sampler and detokenizer per sampled row; the
reference attention loops over prefill chunks (a per-chunk cost) and does chunk x context work in each; decode
attention gathers every decode row's context padded to the longest one (decode_pad), with sum(context) there
in case a kernel without padding replaces it. c_step is the per-step floor (weights streamed once, Python).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FEATURES = ("step", "tokens", "sampled", "prefill_chunks", "prefill_attn", "decode_ctx", "decode_pad")
FORM = ("t = c_step + c_token*tokens + c_sample*sampled_rows + c_chunk*prefill_chunks + "
        "c_prefill_attn*sum(chunk*context)/1e3 + c_decode_ctx*sum(decode context)/1e3 + "
        "c_decode_pad*decode_rows*max(decode context)/1e3   [ms; coefficients >= 0, per thread count]")


def step_features(scheduled) -> tuple[float, ...]:
    """Features of one step, from the scheduler's [(seq, num_new_tokens)] BEFORE advance() (the tokens'
    positions are num_computed_tokens .. num_computed_tokens + num_new)."""
    tokens = sampled = chunks = decodes = 0
    prefill_attn = decode_ctx = longest = 0
    for seq, n in scheduled:
        end = seq.num_computed_tokens + n
        tokens += n
        if end == len(seq.token_ids):
            sampled += 1
        if n == 1:  # a one-token query takes the batched decode path, whatever its phase
            decodes += 1
            decode_ctx += end
            if end > longest:
                longest = end
        else:
            chunks += 1
            prefill_attn += n * end
    return (1.0, tokens, sampled, chunks, prefill_attn / 1e3, decode_ctx / 1e3, decodes * longest / 1e3)


@dataclass
class Fit:
    coef_ms: dict[str, float]
    stats: dict[str, float] = field(default_factory=dict)

    def predict_ms(self, features) -> float:
        return sum(self.coef_ms[name] * x for name, x in zip(FEATURES, features))


def fit(points: list[dict], folds: int = 5) -> Fit:
    """Non-negative least squares on relative error (each row divided by its measured time, so a 30 ms step
    counts as much as a 600 ms one), with k-fold cross-validated error beside the in-sample one."""
    from scipy.optimize import nnls

    x = np.array([[p["features"][k] for k in range(len(FEATURES))] for p in points], dtype=float)
    y = np.array([p["step_ms"] for p in points], dtype=float)
    w = 1.0 / y

    def solve(idx):
        coef, _ = nnls(x[idx] * w[idx, None], y[idx] * w[idx])
        return coef

    coef = solve(np.arange(len(y)))
    rel = (x @ coef - y) / y
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    cv_rel = np.empty(len(y))
    for k in range(folds):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        cv_rel[test] = (x[test] @ solve(train) - y[test]) / y[test]
    stats = {
        "points": len(y),
        "rms_rel_err": float(np.sqrt(np.mean(rel ** 2))),
        "mean_abs_rel_err": float(np.mean(np.abs(rel))),
        "max_abs_rel_err": float(np.max(np.abs(rel))),
        "cv_mean_abs_rel_err": float(np.mean(np.abs(cv_rel))),
        "cv_max_abs_rel_err": float(np.max(np.abs(cv_rel))),
        "rmse_ms": float(np.sqrt(np.mean((x @ coef - y) ** 2))),
    }
    return Fit(dict(zip(FEATURES, (float(c) for c in coef))), stats)


class CostModel:
    """cost.json: fitted coefficients per thread count, and what they hold for (host, model, dtype, code)."""

    def __init__(self, data: dict):
        self.data = data
        self.fits = {int(t): Fit(f["coef_ms"], f.get("stats", {})) for t, f in data["fits"].items()}

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        return cls(json.loads(Path(path).read_text()))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.data, indent=1) + "\n")

    @property
    def threads(self) -> list[int]:
        return sorted(self.fits)

    @property
    def kv_bytes_per_token(self) -> int:
        return int(self.data["model"]["kv_bytes_per_token"])

    def step_seconds(self, threads: int) -> "StepCost":
        if threads not in self.fits:
            raise ValueError(f"threads={threads} was not calibrated: allowed {', '.join(map(str, self.threads))} "
                             "(rerun `perf/tune.py calibrate --threads ...`)")
        return StepCost(self.fits[threads].coef_ms)


class StepCost:
    """A callable scheduled -> seconds, made quick: the simulator calls it once per step."""

    def __init__(self, coef_ms: dict[str, float]):
        self.coef = tuple(coef_ms[name] / 1e3 for name in FEATURES)

    def __call__(self, scheduled) -> float:
        c, f = self.coef, step_features(scheduled)
        return c[0] + c[1] * f[1] + c[2] * f[2] + c[3] * f[3] + c[4] * f[4] + c[5] * f[5] + c[6] * f[6]


def constant(seconds_per_step: float, seconds_per_token: float = 0.0) -> StepCost:
    """A hand-made cost model (tests, what-ifs): a fixed cost per step plus one per scheduled token."""
    coef = dict.fromkeys(FEATURES, 0.0)
    coef["step"], coef["tokens"] = seconds_per_step * 1e3, seconds_per_token * 1e3
    return StepCost(coef)
