"""Uncertainty of τ: percentile-bootstrap confidence intervals over prompts, paired differences of two drafts on
the same prompts, and t-intervals over seeds. Pure functions of numbers (numpy only).

A request's counts are ``{"steps": verification steps, "accepted": accepted drafted tokens}`` (the ``per_prompt``
entries of the eval report). Its τ is ``1 + accepted / steps``; the pooled τ of a set of requests is
``1 + sum(accepted) / sum(steps)``, the same quantity as `draft_opd_ray.rollout.records.tau`. Requests with no
verification step carry no information about τ and are left out (in a paired comparison, from both sides).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Counts = Sequence[Mapping[str, float]]
N_BOOT = 2000
LEVEL = 0.95
SEED = 0


def _arrays(counts: Counts) -> tuple[np.ndarray, np.ndarray]:
    """(accepted, steps) as float arrays, one entry per request."""
    acc = np.array([float(c["accepted"]) for c in counts], dtype=np.float64)
    steps = np.array([float(c["steps"]) for c in counts], dtype=np.float64)
    return acc, steps


def request_taus(counts: Counts) -> np.ndarray:
    """τ of each request; NaN where it had no verification step."""
    acc, steps = _arrays(counts)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(steps > 0, 1.0 + acc / np.where(steps > 0, steps, 1.0), np.nan)


def pooled_tau(counts: Counts) -> float:
    """1 + (accepted drafted tokens) / (verification steps) over all requests; NaN without any step."""
    acc, steps = _arrays(counts)
    return 1.0 + float(acc.sum() / steps.sum()) if steps.sum() > 0 else float("nan")


def bootstrap_indices(n: int, n_boot: int = N_BOOT, seed: int = SEED) -> np.ndarray:
    """``n_boot`` resamples of ``range(n)`` with replacement, shape (n_boot, n); the same for the same seed."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def _nans(*keys: str) -> dict[str, float]:
    return dict.fromkeys(keys, float("nan"))


def bootstrap_ci(
    counts: Counts, *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
    """Pooled τ with its percentile-bootstrap CI, resampling requests with replacement.

    Returns ``{"n": requests with steps, "tau", "lo", "hi"}``; NaN bounds when no request has a step.
    """
    acc, steps = _arrays(counts)
    keep = steps > 0
    acc, steps = acc[keep], steps[keep]
    n = int(keep.sum())
    if n == 0:
        return {"n": 0, **_nans("tau", "lo", "hi")}
    idx = bootstrap_indices(n, n_boot, seed)
    samples = 1.0 + acc[idx].sum(axis=1) / steps[idx].sum(axis=1)
    lo, hi = _percentiles(samples, level)
    return {"n": n, "tau": 1.0 + float(acc.sum() / steps.sum()), "lo": lo, "hi": hi}


def bootstrap_mean_ci(
    values: Sequence[float] | np.ndarray, *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
    """Mean of ``values`` with its percentile-bootstrap CI: ``{"n", "mean", "lo", "hi"}``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"n": 0, **_nans("mean", "lo", "hi")}
    lo, hi = _percentiles(v[bootstrap_indices(v.size, n_boot, seed)].mean(axis=1), level)
    return {"n": int(v.size), "mean": float(v.mean()), "lo": lo, "hi": hi}


def _paired_arrays(a: Counts, b: Counts) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(acc_a, steps_a, acc_b, steps_b) on the prompts where both sides took a step."""
    if len(a) != len(b):
        raise ValueError(
            f"a paired difference needs the same prompts in the same order: a has n={len(a)} requests, "
            f"b has n={len(b)}"
        )
    acc_a, steps_a = _arrays(a)
    acc_b, steps_b = _arrays(b)
    keep = (steps_a > 0) & (steps_b > 0)
    return acc_a[keep], steps_a[keep], acc_b[keep], steps_b[keep]


def prompt_diffs(a: Counts, b: Counts) -> np.ndarray:
    """τ_i(a) − τ_i(b) per prompt, on the prompts where both sides took a verification step."""
    acc_a, steps_a, acc_b, steps_b = _paired_arrays(a, b)
    return (acc_a / steps_a) - (acc_b / steps_b)


def paired_diff(
    a: Counts, b: Counts, *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
    """Draft ``a`` minus draft ``b`` on the same prompts (same order).

    ``mean``/``lo``/``hi``: mean per-prompt τ difference and its bootstrap CI; ``pooled``/``pooled_lo``/
    ``pooled_hi``: difference of pooled τ with a paired bootstrap CI (the same resampled prompts on both
    sides); ``share_better``: fraction of prompts where τ_i(a) > τ_i(b); ``n``: prompts compared.
    """
    acc_a, steps_a, acc_b, steps_b = _paired_arrays(a, b)
    n = int(acc_a.size)
    if n == 0:
        return {"n": 0, **_nans("mean", "lo", "hi", "pooled", "pooled_lo", "pooled_hi", "share_better")}
    diffs = acc_a / steps_a - acc_b / steps_b
    idx = bootstrap_indices(n, n_boot, seed)
    pooled_samples = acc_a[idx].sum(1) / steps_a[idx].sum(1) - acc_b[idx].sum(1) / steps_b[idx].sum(1)
    lo, hi = _percentiles(diffs[idx].mean(axis=1), level)
    pooled_lo, pooled_hi = _percentiles(pooled_samples, level)
    return {
        "n": n,
        "mean": float(diffs.mean()),
        "lo": lo,
        "hi": hi,
        "pooled": float(acc_a.sum() / steps_a.sum() - acc_b.sum() / steps_b.sum()),
        "pooled_lo": pooled_lo,
        "pooled_hi": pooled_hi,
        "share_better": float((diffs > 0).mean()),
    }


def t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df`` >= 1 degrees of freedom (closed form in θ = atan(t/√df))."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:  # sin θ · Σ_k (1·3···(2k−1))/(2·4···2k) cos^{2k} θ, k = 0..(df−2)/2
        term = total = 1.0
        for k in range(1, df // 2):
            term *= (2 * k - 1) / (2 * k) * c2
            total += term
        return s * total
    # (2/π)(θ + sin θ · Σ_k (2·4···2k)/(3·5···(2k+1)) cos^{2k+1} θ, k = 0..(df−3)/2)
    term = total = math.sqrt(c2)
    if df == 1:
        total = 0.0
    for k in range(1, (df - 1) // 2):
        term *= (2 * k) / (2 * k + 1) * c2
        total += term
    return 2.0 / math.pi * (theta + s * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| < t) = ``level`` (e.g. 12.706 for level 0.95, df 1), by bisection."""
    if not 0.0 < level < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0 < level < 1 and df >= 1, got level={level}, df={df}")
    lo, hi = 0.0, 1.0
    while t_central(hi, df) < level:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_central(mid, df) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Sequence[float] | np.ndarray, *, level: float = LEVEL) -> dict[str, float]:
    """Mean over seeds with its t-interval: ``{"n", "mean", "lo", "hi"}``; with one value lo = hi = mean."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"n": 0, **_nans("mean", "lo", "hi")}
    mean = float(v.mean())
    if v.size == 1:
        return {"n": 1, "mean": mean, "lo": mean, "hi": mean}
    half = t_quantile(level, v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return {"n": int(v.size), "mean": mean, "lo": mean - half, "hi": mean + half}
