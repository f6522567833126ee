"""Uncertainty of τ: percentile-bootstrap confidence intervals over prompts, paired differences of two drafts on
the same prompts, t-intervals over seeds, and comparisons over several seeds. Pure functions of numbers (numpy).

A request's counts are ``{"steps": verification steps, "accepted": accepted drafted tokens}`` (the ``per_prompt``
entries of the eval report). Its τ is ``1 + accepted / steps``; the pooled τ of a set of requests is
``1 + sum(accepted) / sum(steps)``, the same quantity as `draft_opd_ray.rollout.records.tau`. Requests with no
verification step carry no information about τ and are left out (in a paired comparison, from both sides).

Over several seeds (one trained draft per seed, each measured on the same P prompts) the data are a grid, prompt
by seed, and the same prompt appears once per seed: its seeds are not more prompts. A comparison of arm A with
baseline B is ``d[p, s] = τ_A(p, s) − τ_B(p, s)`` (seed s of A against seed s of B, or against the one branch
point), summarised as the mean over prompts of the mean over seeds, with three intervals:

- **prompt-clustered** (`prompt_clustered_ci`, the one verdicts read): resample prompts with replacement, each
  carrying its mean over seeds. Its coverage holds whatever ρ (how closely a prompt's difference repeats across
  seeds): 0.94 at ρ = 0.2 and at ρ = 0.8 on synthetic grids of 80 prompts x 3 seeds
  (`tests/unit/test_stats_seeds.py`). The two-level bootstrap (also resample each resampled prompt's seeds,
  ``resample_seeds=True``) counts the within-prompt seed variance a second time ((S − 1)/S of it again): it
  over-covers where ρ is small (0.98 at ρ = 0.2), so it is kept for comparison only.
- **seed-level** (`seed_level_ci`): each seed's mean over prompts and a t-interval over those S means (NaN with
  one seed). Training noise that moves all of a seed's prompts together (a seed main effect) is invisible to the
  prompt-clustered interval, which takes the trained drafts as given (coverage 0.71 in the test's grid with such
  an effect); the seed-level interval sees it (0.94) but takes the prompts as given (0.63 where prompts differ
  and seeds agree). A claim about the training recipe rather than about these drafts needs both to exclude zero.
- **naive pooled** (`naive_pooled_ci`): every (prompt, seed) pair as an independent prompt, too narrow by about
  √(1 + ρ) (coverage 0.74 at ρ = 0.8); kept only to show what pooling did.

An arm's own τ over seeds (`arm_tau_ci`) is the mean over seeds of each seed's pooled τ, and P1 (`ratio_ci`) is
the ratio of two such means, each with the prompt-clustered interval (the same resampled prompts on both sides).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

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


# ------------------------------------------------------------------------------------------------ over seeds


def count_grid(per_seed: Sequence[Counts]) -> tuple[np.ndarray, np.ndarray]:
    """(accepted, steps), each of shape (P, S): column s holds seed s's counts, the same prompts in the same
    order in every seed."""
    sizes = sorted({len(c) for c in per_seed})
    if len(sizes) != 1:
        raise ValueError(f"every seed needs the same prompts: got {len(per_seed)} seeds of sizes {sizes}")
    cols = [_arrays(c) for c in per_seed]
    return np.stack([a for a, _ in cols], axis=1), np.stack([s for _, s in cols], axis=1)


def diff_grid(a: Sequence[Counts], b: Sequence[Counts]) -> np.ndarray:
    """τ_a(p, s) − τ_b(p, s), shape (P, S): seed s of ``a`` against seed s of ``b`` (``[branch] * S`` compares
    every seed with one draft); NaN where either side took no verification step on that prompt."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired grid needs as many seeds on both sides (>= 1): {len(a)} and {len(b)}")
    acc_a, steps_a = count_grid(a)
    acc_b, steps_b = count_grid(b)
    if acc_a.shape != acc_b.shape:
        raise ValueError(f"a paired grid needs the same prompts: {acc_a.shape[0]} and {acc_b.shape[0]}")
    ok = (steps_a > 0) & (steps_b > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, acc_a / steps_a - acc_b / steps_b, np.nan)


def _informative(d: np.ndarray) -> np.ndarray:
    """The rows (prompts) of a (P, S) grid with at least one finite entry."""
    return d[np.isfinite(d).any(axis=1)]


def prompt_clustered_ci(
    d: np.ndarray,
    *,
    resample_seeds: bool = False,
    n_boot: int = N_BOOT,
    seed: int = SEED,
    level: float = LEVEL,
) -> dict[str, float]:
    """Mean over prompts of each prompt's mean over its finite seeds, of a (P, S) grid, with a percentile-
    bootstrap CI that resamples prompts (`bootstrap_indices`); with ``resample_seeds`` also each resampled
    prompt's finite seeds (the two-level bootstrap, conservative: see the module docstring).

    Returns ``{"n": prompts, "prompts", "seeds", "mean", "lo", "hi"}``; prompts with no finite entry are left out.
    """
    d = np.asarray(d, dtype=np.float64)
    d = _informative(d[:, None] if d.ndim == 1 else d)
    n_prompts, n_seeds = d.shape
    if n_prompts == 0:
        return {"n": 0, "prompts": 0, "seeds": n_seeds, **_nans("mean", "lo", "hi")}
    idx = bootstrap_indices(n_prompts, n_boot, seed)  # (B, P)
    if resample_seeds:
        rows = np.sort(d, axis=1)  # each prompt's finite seeds first, NaN last
        finite = np.isfinite(rows).sum(axis=1)  # (P,)
        draw = np.random.default_rng([seed, 1]).random((n_boot, n_prompts, n_seeds))
        cols = (draw * finite[idx][..., None]).astype(np.int64)  # (B, P, S), each below its prompt's count
        samples = rows[idx[..., None], cols].mean(axis=(1, 2))
    else:
        samples = np.nanmean(d, axis=1)[idx].mean(axis=1)
    lo, hi = _percentiles(samples, level)
    mean = float(np.nanmean(d, axis=1).mean())
    return {"n": n_prompts, "prompts": n_prompts, "seeds": n_seeds, "mean": mean, "lo": lo, "hi": hi}


def seed_level_ci(d: np.ndarray, *, level: float = LEVEL) -> dict[str, Any]:
    """Each seed's mean over its finite prompts of a (P, S) grid, and a t-interval over those seed means:
    ``{"n": seeds, "per_seed", "mean", "lo", "hi", "note"}``; with one seed the bounds are NaN ("one seed")."""
    d = np.asarray(d, dtype=np.float64)
    cols = [c[np.isfinite(c)] for c in d.T]
    per_seed = [float(c.mean()) for c in cols if c.size]
    out: dict[str, Any] = {**mean_ci(per_seed, level=level), "per_seed": per_seed, "note": ""}
    if len(per_seed) == 1:
        out.update(lo=float("nan"), hi=float("nan"), note="one seed")
    return out


def naive_pooled_ci(
    d: np.ndarray, *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, float]:
    """Every finite (prompt, seed) entry as an independent prompt (`bootstrap_mean_ci`): too narrow when a
    prompt's values repeat across seeds; for comparison only."""
    d = np.asarray(d, dtype=np.float64)
    return bootstrap_mean_ci(d[np.isfinite(d)], n_boot=n_boot, seed=seed, level=level)


def paired_over_seeds(
    a: Sequence[Counts], b: Sequence[Counts], *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, Any]:
    """Arm ``a`` minus ``b`` over seeds (seed s against seed s; ``[branch] * S`` against one draft): the
    prompt-clustered mean and CI (`prompt_clustered_ci`) at the top level, ``seed_level`` (`seed_level_ci`),
    ``naive`` (`naive_pooled_ci`) and ``share_better`` (share of prompts whose seed mean is above zero)."""
    d = diff_grid(a, b)
    rows = _informative(d)
    return {
        **prompt_clustered_ci(d, n_boot=n_boot, seed=seed, level=level),
        "seed_level": seed_level_ci(d, level=level),
        "naive": naive_pooled_ci(d, n_boot=n_boot, seed=seed, level=level),
        "share_better": float((np.nanmean(rows, axis=1) > 0).mean()) if len(rows) else float("nan"),
    }


def _mean_tau(acc: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Mean over seeds of each seed's pooled τ; ``acc``/``steps`` of shape (..., P, S) -> (...); NaN where no
    seed has a step (a resample of prompts none of which took one)."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of all-NaN: NaN, no warning
        return np.nanmean(1.0 + acc.sum(axis=-2) / steps.sum(axis=-2), axis=-1)


def _taus_and_samples(
    per_seed: Sequence[Counts], idx: np.ndarray | None
) -> tuple[list[float], float, np.ndarray]:
    """Per-seed pooled τ, their mean, and that mean on each resample of prompts ``idx`` (B, P)."""
    acc, steps = count_grid(per_seed)
    taus = [1.0 + float(a / s) if s > 0 else float("nan") for a, s in zip(acc.sum(0), steps.sum(0))]
    samples = _mean_tau(acc[idx], steps[idx]) if idx is not None else np.empty(0)
    return taus, float(_mean_tau(acc, steps)), samples


def _informative_prompts(*grids: Sequence[Counts]) -> int:
    """Prompts with a verification step in some seed of some grid (the others add nothing to pooled τ)."""
    steps = np.concatenate([count_grid(g)[1] for g in grids], axis=1)
    return int((steps > 0).any(axis=1).sum())


def arm_tau_ci(
    per_seed: Sequence[Counts], *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, Any]:
    """An arm's τ over seeds: the mean over seeds of each seed's pooled τ, with the prompt-clustered CI (the
    same resampled prompts in every seed) and the seed-level t-interval of the per-seed τ (NaN with one seed).

    Returns ``{"prompts", "seeds", "tau", "lo", "hi", "per_seed", "seed_level"}``.
    """
    n_prompts = len(per_seed[0]) if per_seed else 0
    taus, tau, samples = _taus_and_samples(per_seed, bootstrap_indices(n_prompts, n_boot, seed))
    ok = np.isfinite(samples)
    lo, hi = _percentiles(samples[ok], level) if ok.any() else (float("nan"), float("nan"))
    seed_level = seed_level_ci(np.asarray([taus]), level=level)
    return {
        "prompts": _informative_prompts(per_seed),
        "seeds": len(per_seed),
        "tau": tau,
        "lo": lo,
        "hi": hi,
        "per_seed": taus,
        "seed_level": {k: seed_level[k] for k in ("n", "mean", "lo", "hi", "note")},
    }


def ratio_ci(
    a: Sequence[Counts], b: Sequence[Counts], *, n_boot: int = N_BOOT, seed: int = SEED, level: float = LEVEL
) -> dict[str, Any]:
    """P1-style ratio τ_a / τ_b, each the mean over its seeds of the seed's pooled τ (ratio of means of pooled
    τ, not of per-prompt τ), with the prompt-clustered CI: the same resampled prompts for both arms and all
    their seeds. The arms may have different seeds but need the same prompts.

    Returns ``{"prompts", "seeds_a", "seeds_b", "ratio", "lo", "hi"}``.
    """
    sizes = {len(c) for c in [*a, *b]}
    if len(sizes) != 1:
        raise ValueError(f"a ratio of τ needs the same prompts on both sides: sizes {sorted(sizes)}")
    idx = bootstrap_indices(sizes.pop(), n_boot, seed)
    _, tau_a, samples_a = _taus_and_samples(a, idx)
    _, tau_b, samples_b = _taus_and_samples(b, idx)
    samples = samples_a / samples_b
    ok = np.isfinite(samples)
    lo, hi = _percentiles(samples[ok], level) if ok.any() else (float("nan"), float("nan"))
    return {
        "prompts": _informative_prompts(a, b),
        "seeds_a": len(a),
        "seeds_b": len(b),
        "ratio": tau_a / tau_b,
        "lo": lo,
        "hi": hi,
    }
