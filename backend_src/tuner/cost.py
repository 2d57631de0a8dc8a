"""The step-cost model: how long one engine step takes on this host, from what the scheduler put in it.

Form (one coefficient set per torch thread count, all >= 0, fitted by non-negative least squares):

    t = c_step + c_token * tokens + c_sample * sampled_rows + c_chunk * prefill_chunks
        + c_prefill_attn * sum(chunk_len * context_len) / 1e3
        + c_decode_ctx * sum(decode context) / 1e3 + c_decode_pad * decode_rows * longest_decode_context / 1e3
        + c_decode_spill * max(0, decode_rows * longest_decode_context - knee) / 1e3

Why these terms: the linears cost per token; the lm_head, sampler and detokenizer per sampled row; the
reference attention loops over prefill chunks (a per-chunk cost) and does chunk x context work in each; decode
attention gathers every decode row's context padded to the longest one (decode_pad), with sum(context) there
in case a kernel without padding replaces it. Past some size (the knee, chosen by cross-validation) the
gathered K/V no longer fit in the CPU's last-level cache and each position costs more (decode_spill).
c_step is the per-step floor (weights streamed once, Python).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BASE_FEATURES = ("step", "tokens", "sampled", "prefill_chunks", "prefill_attn", "decode_ctx", "decode_pad")
FEATURES = BASE_FEATURES + ("decode_spill",)
KNEES = (4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 1e9)  # decode rows x longest context, thousands (1e9: no spill term)
FORM = ("t = c_step + c_token*tokens + c_sample*sampled_rows + c_chunk*prefill_chunks + "
        "c_prefill_attn*sum(chunk*context)/1e3 + c_decode_ctx*sum(decode context)/1e3 + "
        "c_decode_pad*P/1e3 + c_decode_spill*max(0, P - knee)/1e3, P = decode_rows*max(decode context)   "
        "[ms; coefficients >= 0, per thread count]")


def step_features(scheduled) -> tuple[float, ...]:
    """The base features of one step, from the scheduler's [(seq, num_new_tokens)] BEFORE advance() (the
    tokens' positions are num_computed_tokens .. num_computed_tokens + num_new)."""
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


def with_spill(base: list[float] | tuple[float, ...], knee: float) -> list[float]:
    return [*base, max(0.0, base[6] - knee)]


@dataclass
class Fit:
    coef_ms: dict[str, float]
    knee: float = 1e9
    stats: dict[str, float] = field(default_factory=dict)

    def predict_ms(self, base_features) -> float:
        return sum(self.coef_ms.get(n, 0.0) * x for n, x in zip(FEATURES, with_spill(base_features, self.knee)))


def _nnls_fit(x: np.ndarray, y: np.ndarray, folds: int) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients on all points and the k-fold cross-validated relative errors. Rows are divided by the
    measured time, so the fit minimizes relative error (a 30 ms step counts as much as a 600 ms one)."""
    from scipy.optimize import nnls

    w = 1.0 / y

    def solve(idx):
        return nnls(x[idx] * w[idx, None], y[idx] * w[idx])[0]

    order = np.random.default_rng(0).permutation(len(y))
    cv_rel = np.empty(len(y))
    for k in range(folds):
        test = order[k::folds]
        cv_rel[test] = (x[test] @ solve(np.setdiff1d(order, test)) - y[test]) / y[test]
    return solve(np.arange(len(y))), cv_rel


def fit(points: list[dict], folds: int = 5) -> Fit:
    """Fit every knee in KNEES, keep the one with the least cross-validated error."""
    y = np.array([p["step_ms"] for p in points], dtype=float)
    best = None
    for knee in KNEES:
        x = np.array([with_spill(p["features"][:len(BASE_FEATURES)], knee) for p in points], dtype=float)
        coef, cv_rel = _nnls_fit(x, y, folds)
        score = float(np.mean(np.abs(cv_rel)))
        if best is None or score < best[0] - 1e-9:
            best = (score, knee, x, coef, cv_rel)
    _, knee, x, coef, cv_rel = best
    rel = (x @ coef - y) / y
    stats = {
        "points": len(y),
        "rms_rel_err": float(np.sqrt(np.mean(rel ** 2))),
        "mean_abs_rel_err": float(np.mean(np.abs(rel))),
        "max_abs_rel_err": float(np.max(np.abs(rel))),
        "cv_mean_abs_rel_err": float(np.mean(np.abs(cv_rel))),
        "cv_max_abs_rel_err": float(np.max(np.abs(cv_rel))),
        "rmse_ms": float(np.sqrt(np.mean((x @ coef - y) ** 2))),
    }
    return Fit(dict(zip(FEATURES, (float(c) for c in coef))), knee, stats)


class CostModel:
    """cost.json: fitted coefficients per thread count, and what they hold for (host, model, dtype, code)."""

    def __init__(self, data: dict):
        self.data = data
        self.fits = {int(t): Fit(f["coef_ms"], f.get("knee", 1e9), f.get("stats", {}))
                     for t, f in data["fits"].items()}

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

    @property
    def server_step_scale(self) -> float:
        """How much longer a step takes inside tritonserver than the engine alone (calibrate times), at the
        host's default thread count: see server_scale_for."""
        return self.server_scale_for(int(self.data["host"].get("default_threads", 1)))

    def server_scale_for(self, threads: int) -> float:
        """The server's step-time factor for this many torch threads: the gRPC frontend, the backend's IPC,
        the response sender and the clients share the CPUs with the engine's threads. Measured by verify,
        recorded by `python -m tuner server-scale` (one number, or one per thread count); 1.0 until then."""
        scale = (self.data.get("server") or {}).get("step_scale", 1.0)
        if isinstance(scale, dict):
            return float(scale.get(str(threads), 1.0))
        return float(scale)

    def step_seconds(self, threads: int, scale: float | None = None) -> "StepCost":
        """The step cost on the server: the fitted engine step x server_scale_for(threads) (or `scale`)."""
        if threads not in self.fits:
            raise ValueError(f"threads={threads} was not calibrated: allowed {', '.join(map(str, self.threads))} "
                             "(rerun `python -m tuner calibrate --threads ...`)")
        f = self.fits[threads]
        k = self.server_scale_for(threads) if scale is None else scale
        return StepCost({name: k * v for name, v in f.coef_ms.items()}, f.knee)


class StepCost:
    """A callable scheduled -> seconds, made quick: the simulator calls it once per step."""

    def __init__(self, coef_ms: dict[str, float], knee: float = 1e9):
        self.coef = tuple(coef_ms.get(name, 0.0) / 1e3 for name in FEATURES)
        self.knee = knee

    def __call__(self, scheduled) -> float:
        c, f = self.coef, step_features(scheduled)
        spill = f[6] - self.knee
        return (c[0] + c[1] * f[1] + c[2] * f[2] + c[3] * f[3] + c[4] * f[4] + c[5] * f[5] + c[6] * f[6]
                + (c[7] * spill if spill > 0 else 0.0))


def constant(seconds_per_step: float, seconds_per_token: float = 0.0) -> StepCost:
    """A hand-made cost model (tests, what-ifs): a fixed cost per step plus one per scheduled token."""
    coef = dict.fromkeys(FEATURES, 0.0)
    coef["step"], coef["tokens"] = seconds_per_step * 1e3, seconds_per_token * 1e3
    return StepCost(coef)
