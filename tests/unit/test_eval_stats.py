"""τ's uncertainty (`draft_opd_ray.eval.stats`) against brute force: bootstrap CIs against a plain loop over the
same resamples and against exact enumeration of all resamples, paired differences prompt by prompt, t-intervals
against scipy and the t table. Then the eval report built from a fake engine: n, CIs, per-prompt counts,
paired entries, the markdown lines and the speed-up plot, and the one-line error for an empty eval set."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from draft_opd_ray.config.schema import ClusterConfig, DraftConfig, EvalConfig, RolloutConfig, TargetConfig
from draft_opd_ray.errors import DataError
from draft_opd_ray.eval import evaluate as ev
from draft_opd_ray.eval.stats import (
    bootstrap_ci,
    bootstrap_indices,
    bootstrap_mean_ci,
    mean_ci,
    paired_diff,
    pooled_tau,
    prompt_diffs,
    request_taus,
    t_central,
    t_quantile,
)
from draft_opd_ray.eval.tau import per_prompt, tau_stats
from draft_opd_ray.rollout.records import tau
from draft_opd_ray.wire import RequestRecord
from tests.helpers import synth


def _records(seed: int, n: int, num_speculative_tokens: int = 4) -> list[RequestRecord]:
    rng = random.Random(seed)
    return [
        synth(rng, num_speculative_tokens=num_speculative_tokens, steps=rng.randint(1, 7)) for _ in range(n)
    ]


def _counts(recs: list[RequestRecord]) -> list[dict[str, int]]:
    return [{"steps": r.num_steps, "accepted": sum(r.accepted)} for r in recs]


def _percentile_pair(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


# ------------------------------------------------------------------------------------------------ τ


def test_request_and_pooled_tau_match_the_records() -> None:
    recs = _records(0, 9)
    counts = _counts(recs) + [{"steps": 0, "accepted": 0}]
    taus = request_taus(counts)
    for r, t in zip(recs, taus):
        assert t == pytest.approx(1 + sum(r.accepted) / len(r.accepted))
    assert math.isnan(taus[-1])
    assert pooled_tau(counts) == pytest.approx(tau(recs))
    assert math.isnan(pooled_tau([{"steps": 0, "accepted": 0}]))


def test_per_prompt_counts_where_tau_stats_counts() -> None:
    recs = _records(1, 4)
    failed = RequestRecord([1], [], error="empty prompt", finish_reason="error")
    failed.accepted = [3, 3]  # a failed request counts nothing, whatever it holds
    pp = per_prompt([recs[0], failed, *recs[1:]])
    assert len(pp) == 5 and pp[1] == {"steps": 0, "accepted": 0, "tokens": 0}
    assert pp[0] == {
        "steps": recs[0].num_steps,
        "accepted": sum(recs[0].accepted),
        "tokens": len(recs[0].response_ids),
    }
    assert pooled_tau(pp) == pytest.approx(tau_stats([recs[0], failed, *recs[1:]])["tau"])
    plain = [RequestRecord([1], [5, 6, 7], vllm_steps=4, vllm_accepted=6), RequestRecord([2], [8])]
    assert per_prompt(plain) == [
        {"steps": 4, "accepted": 6, "tokens": 3},
        {"steps": 0, "accepted": 0, "tokens": 1},
    ]
    assert pooled_tau(per_prompt(plain)) == tau_stats(plain)["tau"]


# ------------------------------------------------------------------------------------------------ bootstrap


def test_bootstrap_ci_equals_a_loop_over_the_same_resamples() -> None:
    recs = _records(2, 12)
    idx = bootstrap_indices(len(recs), 500, seed=7)
    lo, hi = _percentile_pair([tau([recs[i] for i in row]) for row in idx])
    got = bootstrap_ci(_counts(recs), n_boot=500, seed=7)
    assert got["n"] == 12 and got["tau"] == pytest.approx(tau(recs))
    assert (got["lo"], got["hi"]) == pytest.approx((lo, hi), abs=1e-12)
    assert got == bootstrap_ci(_counts(recs), n_boot=500, seed=7)  # fixed seed: reproducible
    assert bootstrap_indices(3).shape == (2000, 3)  # default: 2000 resamples


def test_bootstrap_ci_matches_exact_enumeration_of_all_resamples() -> None:
    counts = [{"steps": 4, "accepted": 1}, {"steps": 2, "accepted": 2}, {"steps": 5, "accepted": 9}]
    exact = sorted(pooled_tau([counts[i] for i in pick]) for pick in itertools.product(range(3), repeat=3))
    q = lambda p: exact[min(int(p * len(exact)), len(exact) - 1)]  # noqa: E731
    got = bootstrap_ci(counts, n_boot=40000, seed=1)
    assert q(0.01) <= got["lo"] <= q(0.05) and q(0.95) <= got["hi"] <= q(0.99)
    assert got["lo"] <= got["tau"] <= got["hi"]


def test_bootstrap_ci_leaves_out_requests_without_steps_and_handles_one_or_none() -> None:
    counts = _counts(_records(3, 6))
    with_empty = counts[:2] + [{"steps": 0, "accepted": 0}] + counts[2:]
    assert bootstrap_ci(with_empty) == bootstrap_ci(counts)
    one = bootstrap_ci([{"steps": 3, "accepted": 2}])
    assert one == {"n": 1, "tau": 1 + 2 / 3, "lo": 1 + 2 / 3, "hi": 1 + 2 / 3}
    none = bootstrap_ci([{"steps": 0, "accepted": 0}])
    assert none["n"] == 0 and math.isnan(none["tau"]) and math.isnan(none["lo"])


def test_bootstrap_mean_ci_equals_a_loop() -> None:
    values = [0.3, -0.1, 0.25, 0.0, 0.4, 0.1]
    idx = bootstrap_indices(len(values), 300, seed=4)
    lo, hi = _percentile_pair([sum(values[i] for i in row) / len(row) for row in idx])
    got = bootstrap_mean_ci(values, n_boot=300, seed=4)
    assert got["n"] == 6 and got["mean"] == pytest.approx(sum(values) / 6)
    assert (got["lo"], got["hi"]) == pytest.approx((lo, hi), abs=1e-12)


# ------------------------------------------------------------------------------------------------ paired


def test_paired_diff_equals_prompt_by_prompt_loops() -> None:
    a, b = _counts(_records(5, 10)), _counts(_records(6, 10))
    a[1] = {"steps": 0, "accepted": 0}  # no step on one side: that prompt leaves both sides
    b[4] = {"steps": 0, "accepted": 0}
    keep = [i for i in range(10) if i not in (1, 4)]
    diffs = [(1 + a[i]["accepted"] / a[i]["steps"]) - (1 + b[i]["accepted"] / b[i]["steps"]) for i in keep]
    got = paired_diff(a, b, n_boot=400, seed=3)
    assert got["n"] == 8
    assert got["mean"] == pytest.approx(sum(diffs) / 8)
    assert got["share_better"] == pytest.approx(sum(d > 0 for d in diffs) / 8)
    assert got["pooled"] == pytest.approx(pooled_tau([a[i] for i in keep]) - pooled_tau([b[i] for i in keep]))
    idx = bootstrap_indices(8, 400, seed=3)
    mean_lo, mean_hi = _percentile_pair([sum(diffs[j] for j in row) / 8 for row in idx])
    pooled_lo, pooled_hi = _percentile_pair(
        [pooled_tau([a[keep[j]] for j in row]) - pooled_tau([b[keep[j]] for j in row]) for row in idx]
    )
    assert (got["lo"], got["hi"]) == pytest.approx((mean_lo, mean_hi), abs=1e-12)
    assert (got["pooled_lo"], got["pooled_hi"]) == pytest.approx((pooled_lo, pooled_hi), abs=1e-12)
    assert list(prompt_diffs(a, b)) == pytest.approx(diffs)


def test_paired_diff_of_identical_drafts_is_zero() -> None:
    a = _counts(_records(7, 9))
    got = paired_diff(a, [dict(c) for c in a])
    assert got["n"] == 9 and got["share_better"] == 0.0
    assert [got[k] for k in ("mean", "lo", "hi", "pooled", "pooled_lo", "pooled_hi")] == [0.0] * 6


def test_paired_diff_needs_the_same_prompts() -> None:
    with pytest.raises(ValueError, match=r"a has n=3 .* b has n=4"):
        paired_diff(_counts(_records(8, 3)), _counts(_records(9, 4)))


# ------------------------------------------------------------------------------------------------ over seeds


@pytest.mark.parametrize(("df", "table"), [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (100, 1.984)])
def test_t_quantile_matches_the_t_table(df: int, table: float) -> None:
    assert t_quantile(0.95, df) == pytest.approx(table, abs=5e-4)


def test_t_distribution_matches_scipy() -> None:
    st = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 5, 8, 31, 200):
        for t in (0.1, 1.0, 2.5, 9.0):
            assert t_central(t, df) == pytest.approx(st.t.cdf(t, df) - st.t.cdf(-t, df), abs=1e-12)
        assert t_quantile(0.95, df) == pytest.approx(st.t.ppf(0.975, df), rel=1e-9)
        assert t_quantile(0.9, df) == pytest.approx(st.t.ppf(0.95, df), rel=1e-9)


def test_mean_ci_is_the_t_interval() -> None:
    values = [2.1, 2.4, 2.2, 2.35]
    mean = sum(values) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
    half = 3.182446305284 * sd / 2  # t(0.975, 3) · s / √4
    got = mean_ci(values)
    assert got["n"] == 4 and got["mean"] == pytest.approx(mean)
    assert (got["lo"], got["hi"]) == pytest.approx((mean - half, mean + half), rel=1e-10)
    assert mean_ci([2.5]) == {"n": 1, "mean": 2.5, "lo": 2.5, "hi": 2.5}
    assert mean_ci([]).get("n") == 0 and mean_ci([2.0, 2.0])["lo"] == mean_ci([2.0, 2.0])["hi"] == 2.0


# ------------------------------------------------------------------------------------------------ the report


class FakeEngine:
    """Stands in for `SpecDecodeEngine`: the draft accepts more after its weights are swapped in, `ngram`
    reports only vLLM's counters, plain decoding reports nothing. One prompt (index 2) always fails."""

    built: list[str] = []

    def __init__(self, run: Any, *configs: Any) -> None:
        self.kind, self.version = run.draft_kind, 0
        self.record = (
            run.record and run.draft_kind != "none"
        )  # as SpecDecodeEngine: nothing to record without a draft
        FakeEngine.built.append(run.draft_kind)

    def generate(self, prompts: list[list[int]], sampling: Any) -> list[RequestRecord]:
        out = []
        for i, p in enumerate(prompts):
            if i == 2:
                out.append(RequestRecord(list(p), [], error="too long", finish_reason="error"))
                continue
            steps = 3 + i % 3
            rec = RequestRecord(list(p), [1] * (2 * steps + 1), finish_reason="length")
            if self.kind == "ngram":
                rec.vllm_steps, rec.vllm_accepted = steps, i % 2
            elif self.kind != "none":
                acc = [min(4, (i + j) % 3 + self.version) for j in range(steps)]
                rec.accepted, rec.drafted = acc, [[1, 2, 3, 4]] * steps
                rec.vllm_steps, rec.vllm_accepted = steps, sum(acc)
            out.append(rec)
        return out

    def load_draft_weights(self, weights: Any, version: int) -> None:
        self.version = version

    def shutdown(self) -> None:
        pass


def _evaluate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, datasets: dict[str, list[list[int]]]) -> Any:
    import safetensors.torch

    FakeEngine.built = []
    monkeypatch.setattr(ev, "SpecDecodeEngine", FakeEngine)
    monkeypatch.setattr(safetensors.torch, "load_file", lambda path: {})
    return ev.evaluate(
        ev.EvalRun(
            "tgt", str(tmp_path / "after"), datasets, tmp_path / "eval", (), before=str(tmp_path / "before")
        ),
        EvalConfig(max_new_tokens=16, concurrency=[1, 2], baselines=["ngram"]),
        DraftConfig(kind="eagle3", num_speculative_tokens=4),
        TargetConfig(),
        RolloutConfig(),
        ClusterConfig(),
    )


def test_report_has_n_cis_per_prompt_counts_and_paired_differences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[i + 1, 7] for i in range(8)]
    report = _evaluate(tmp_path, monkeypatch, {"mtbench": prompts})
    assert FakeEngine.built == ["eagle3", "ngram", "none"]
    e = report["datasets"]["mtbench"]
    assert {"tau", "tau_vllm", "acceptance_per_position", "speedup", "tokens_per_s", "before"} <= set(e)
    assert len(e["per_prompt"]) == 8 and e["per_prompt"][2] == {"steps": 0, "accepted": 0, "tokens": 0}
    assert e["n"] == 7 and e["tau"] == pytest.approx(pooled_tau(e["per_prompt"]))
    assert e["tau_ci"][0] <= e["tau"] <= e["tau_ci"][1]
    assert set(e["before"]) >= {"tau", "tau_vllm", "n", "tau_ci", "per_prompt"}
    assert e["paired"]["before"] == paired_diff(e["per_prompt"], e["before"]["per_prompt"])
    ngram = report["baselines"]["ngram"]["mtbench"]
    assert ngram["per_prompt"][1] == {"steps": 4, "accepted": 1, "tokens": 9}
    assert e["paired"]["ngram"] == paired_diff(e["per_prompt"], ngram["per_prompt"])
    assert e["paired"]["before"]["lo"] > 0  # the swapped-in draft accepts one more token per step, everywhere

    saved = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert saved["datasets"]["mtbench"]["paired"]["before"]["mean"] == pytest.approx(
        e["paired"]["before"]["mean"]
    )
    md = (tmp_path / "eval" / "report.md").read_text()
    p = e["paired"]["before"]
    assert f"after − before: {p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] (CI above zero)" in md
    assert "draft − ngram: " in md
    assert f"| mtbench | draft | 7 | {e['tau']:.3f} [{e['tau_ci'][0]:.3f}, {e['tau_ci'][1]:.3f}] |" in md
    assert (tmp_path / "eval" / "speedup_mtbench.png").is_file()


def test_markdown_reads_reports_without_the_new_keys() -> None:
    old = {
        "target": "t",
        "draft": "d",
        "speculative_config": {},
        "datasets": {
            "x": {"tau": 2.0, "tau_vllm": 2.0, "speedup": {"1": 1.5}, "before": {"tau": 1.5, "tau_vllm": 1.5}}
        },
        "baselines": {},
    }
    md = ev.render_markdown(old)
    assert "| x | draft | - | 2.000 | 2.000 | c=1: 1.50x |" in md and "Paired" not in md


def test_ci_words() -> None:
    assert ev.ci_words(0.01, 0.05) == "CI above zero"
    assert ev.ci_words(-0.05, -0.01) == "CI below zero"
    assert ev.ci_words(0.0, 0.0) == ev.ci_words(-0.1, 0.1) == "CI includes zero"


def test_an_empty_eval_set_fails_before_any_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match=r"^eval set 'mtbench' has no prompts$"):
        _evaluate(tmp_path, monkeypatch, {"humaneval": [[1, 2]], "mtbench": []})
    assert FakeEngine.built == []
