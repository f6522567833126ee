"""Comparisons over several seeds (`draft_opd_ray.eval.stats`): the prompt-clustered and two-level bootstraps, the
seed-level t-interval, the naive pooled interval, an arm's τ over seeds and P1, each against a plain loop over the
same resamples; then their coverage on synthetic prompt x seed grids with known variances."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from draft_opd_ray.eval.stats import (
    arm_tau_ci,
    bootstrap_indices,
    diff_grid,
    naive_pooled_ci,
    paired_over_seeds,
    prompt_clustered_ci,
    ratio_ci,
    seed_level_ci,
)

# 4 prompts x 2 seeds of (steps, accepted); prompt 3 took no step in seed 1 of A, prompt 2 none anywhere in B
A = [[(4, 4), (5, 2), (3, 3), (2, 1)], [(4, 2), (5, 5), (3, 1), (0, 0)]]
B = [[(4, 1), (5, 2), (0, 0), (2, 2)], [(4, 3), (5, 1), (0, 0), (2, 0)]]


def counts(grid: list[list[tuple[int, int]]]) -> list[list[dict[str, int]]]:
    return [[{"steps": s, "accepted": a} for s, a in seed] for seed in grid]


def pct(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


def brute_diffs() -> list[list[float]]:
    """d[p][s] by hand, NaN where either side took no step."""
    return [
        [a[p][1] / a[p][0] - b[p][1] / b[p][0] if a[p][0] and b[p][0] else math.nan for a, b in zip(A, B)]
        for p in range(4)
    ]


def test_diff_grid_and_the_prompt_clustered_interval_match_a_loop() -> None:
    d = brute_diffs()
    assert np.array_equal(diff_grid(counts(A), counts(B)), np.array(d), equal_nan=True)
    kept = [[x for x in row if not math.isnan(x)] for row in d]
    means = [sum(r) / len(r) for r in kept if r]  # prompt 2 has no finite seed: left out
    assert len(means) == 3 and len(kept[3]) == 1  # prompt 3: its one finite seed is its mean
    c = prompt_clustered_ci(np.array(d), n_boot=300, seed=4)
    boot = [np.mean([means[i] for i in row]) for row in bootstrap_indices(3, 300, 4)]
    assert c == pytest.approx(
        {"n": 3, "prompts": 3, "seeds": 2, "mean": sum(means) / 3, "lo": pct(boot)[0], "hi": pct(boot)[1]}
    )


def test_the_two_level_bootstrap_draws_each_prompts_finite_seeds() -> None:
    d = np.array(brute_diffs())
    rows = [
        sorted(x for x in r if not math.isnan(x)) for r in d.tolist() if any(not math.isnan(x) for x in r)
    ]
    n_boot, seed = 200, 7
    draws = np.random.default_rng([seed, 1]).random((n_boot, 3, 2))
    boot = []
    for b, prompts in enumerate(bootstrap_indices(3, n_boot, seed)):
        vals = [rows[p][int(draws[b, j, k] * len(rows[p]))] for j, p in enumerate(prompts) for k in range(2)]
        boot.append(float(np.mean(vals)))
    c = prompt_clustered_ci(d, resample_seeds=True, n_boot=n_boot, seed=seed)
    assert (c["lo"], c["hi"]) == pytest.approx(pct(boot))
    assert c["mean"] == pytest.approx(prompt_clustered_ci(d)["mean"])  # the same statistic, another interval


def test_seed_level_and_naive_intervals() -> None:
    d = np.array(brute_diffs())
    per_seed = [float(np.mean([x for x in col if not math.isnan(x)])) for col in d.T]
    s = seed_level_ci(d)
    half = sps.t.ppf(0.975, 1) * np.std(per_seed, ddof=1) / math.sqrt(2)
    assert s["per_seed"] == pytest.approx(per_seed) and s["n"] == 2 and s["note"] == ""
    assert (s["lo"], s["hi"]) == pytest.approx((np.mean(per_seed) - half, np.mean(per_seed) + half))
    one = seed_level_ci(d[:, :1])
    assert one["note"] == "one seed" and math.isnan(one["lo"]) and math.isnan(one["hi"])
    flat = [x for x in d.ravel() if not math.isnan(x)]
    naive = naive_pooled_ci(d, n_boot=300)
    boot = [np.mean([flat[i] for i in row]) for row in bootstrap_indices(len(flat), 300)]
    assert naive["n"] == 5 and (naive["lo"], naive["hi"]) == pytest.approx(pct(boot))
    both = paired_over_seeds(counts(A), counts(B), n_boot=300)
    assert both["seed_level"]["per_seed"] == pytest.approx(per_seed) and both["naive"]["n"] == 5
    assert both["share_better"] == pytest.approx(2 / 3)  # prompts 0 and 1 above zero, prompt 3 below


def pooled(seed: list[tuple[int, int]], prompts: list[int]) -> float:
    return 1 + sum(seed[p][1] for p in prompts) / sum(seed[p][0] for p in prompts)


def test_arm_tau_and_p1_resample_the_same_prompts_in_every_seed() -> None:
    n_boot, every = 300, [0, 1, 2, 3]
    idx = bootstrap_indices(4, n_boot)
    t = arm_tau_ci(counts(A), n_boot=n_boot)
    per_seed = [pooled(s, every) for s in A]
    boot = [np.mean([pooled(s, list(row)) for s in A]) for row in idx]
    assert t["per_seed"] == pytest.approx(per_seed) and t["tau"] == pytest.approx(np.mean(per_seed))
    assert (t["lo"], t["hi"]) == pytest.approx(pct(boot)) and (t["prompts"], t["seeds"]) == (4, 2)
    assert t["seed_level"]["n"] == 2 and t["seed_level"]["hi"] > t["seed_level"]["lo"]

    r = ratio_ci(counts(A), counts(B[:1]), n_boot=n_boot)  # the arms need not have the same seeds
    ratios = []
    for row in idx:
        if sum(B[0][p][0] for p in row) == 0:  # no step for B in this resample: left out
            continue
        ratios.append(np.mean([pooled(s, list(row)) for s in A]) / pooled(B[0], list(row)))
    assert r["ratio"] == pytest.approx(np.mean(per_seed) / pooled(B[0], every))
    assert (r["lo"], r["hi"]) == pytest.approx(pct(ratios)) and (r["seeds_a"], r["seeds_b"]) == (2, 1)


# ------------------------------------------------------------------------------------------------ coverage

DRAWS, N_BOOT = 400, 1000  # N_BOOT below the module's 2000 to keep the test to seconds


def coverage(sd_prompt: float, sd_within: float, sd_seed: float = 0.0) -> dict[str, float]:
    """Share of DRAWS synthetic 80-prompt x 3-seed grids, true mean 0, whose 95% intervals contain 0.

    d[p, s] = a_p + b_s + e_ps: a_p the prompt effect (sd_prompt), e_ps the prompt x seed interaction, i.e. the
    seed-to-seed variation within a prompt (sd_within), b_s a seed main effect (sd_seed: training noise that moves
    every prompt of a seed together)."""
    rng = np.random.default_rng(12)
    hits = dict.fromkeys(("clustered", "two_level", "naive", "seed_level"), 0)
    for _ in range(DRAWS):
        d = (
            sd_prompt * rng.standard_normal((80, 1))
            + sd_within * rng.standard_normal((80, 3))
            + sd_seed * rng.standard_normal((1, 3))
        )
        for name, c in (
            ("clustered", prompt_clustered_ci(d, n_boot=N_BOOT)),
            ("two_level", prompt_clustered_ci(d, resample_seeds=True, n_boot=N_BOOT)),
            ("naive", naive_pooled_ci(d, n_boot=N_BOOT)),
            ("seed_level", seed_level_ci(d)),
        ):
            hits[name] += c["lo"] <= 0.0 <= c["hi"]
    return {k: v / DRAWS for k, v in hits.items()}


def test_coverage_where_prompts_repeat_across_seeds() -> None:
    """ρ = 0.8 (σ_p = 1, σ_s = 0.5): pooling 240 pairs as independent under-covers; both bootstraps cover."""
    c = coverage(1.0, 0.5)
    print("coverage at rho 0.8:", c)
    assert 0.92 <= c["clustered"] <= 0.98 and 0.92 <= c["two_level"] <= 0.98
    assert c["naive"] < 0.85


def test_coverage_where_seeds_vary_within_prompts() -> None:
    """ρ = 0.2 (σ_p = 0.5, σ_s = 1): the prompt-clustered interval still covers; the two-level one, which adds
    the within-prompt seed variance a second time, over-covers (why it is not the default)."""
    c = coverage(0.5, 1.0)
    print("coverage at rho 0.2:", c)
    assert 0.92 <= c["clustered"] <= 0.98
    assert c["two_level"] > 0.97 and c["two_level"] > c["clustered"]
    assert c["naive"] < c["clustered"]


def test_a_seed_main_effect_is_seen_only_by_the_seed_level_interval() -> None:
    """Training noise that moves all of a seed's prompts together: the prompt-clustered interval treats the
    drafts as fixed and under-covers; the t-interval over the 3 seed means covers."""
    c = coverage(1.0, 0.5, sd_seed=0.3)
    print("coverage with a seed main effect:", c)
    assert c["clustered"] < 0.8 and c["seed_level"] >= 0.88
