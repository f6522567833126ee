"""The published numbers are the committed files' numbers: each interval quoted in docs/results.md and the README is
recomputed here from `results/default_controls` (the raw per-prompt counts) by the same code `python -m
draft_opd_ray.compare` prints them with, and must appear in the documents as recomputed. When a new seed lands, the
files change and this test says which sentences to update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draft_opd_ray.compare_results import (
    compare_study,
    comparison_cell,
    interval,
    ratio_cell,
    render_summary,
    study_number,
)

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "results" / "default_controls"
RESULTS_MD = (REPO / "docs" / "results.md").read_text()
README = (REPO / "README.md").read_text()
BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()

# (set, name as compare prints it, the documents that quote it)
QUOTED = [
    ("validation", "opd − sft", (RESULTS_MD, README)),  # the primary endpoint
    ("mtbench", "opd − sft", (RESULTS_MD,)),
    ("validation", "opd − branch", (RESULTS_MD, README)),
    ("mtbench", "opd − branch", (RESULTS_MD,)),
    ("validation", "sft − branch", (RESULTS_MD,)),
    ("mtbench", "sft − branch", (RESULTS_MD,)),
    ("validation", "P1", (RESULTS_MD,)),
    ("validation", "opd", (RESULTS_MD,)),
    ("validation", "sft", (RESULTS_MD,)),
    ("validation", "branch", (RESULTS_MD,)),
    ("mtbench", "opd", (RESULTS_MD,)),
    ("mtbench", "sft", (RESULTS_MD,)),
    ("mtbench", "branch", (RESULTS_MD,)),
    ("validation", "opd − sft_rollouts_soft", (RESULTS_MD,)),  # the no-replay soft-label control
    ("mtbench", "opd − sft_rollouts_soft", (RESULTS_MD,)),
    ("validation", "sft_rollouts_soft − sft", (RESULTS_MD,)),
    ("mtbench", "sft_rollouts_soft − sft", (RESULTS_MD,)),
    ("validation", "sft_rollouts_soft − branch", (RESULTS_MD,)),
    ("mtbench", "sft_rollouts_soft − branch", (RESULTS_MD,)),
    ("validation", "sft_rollouts_soft", (RESULTS_MD,)),
    ("mtbench", "sft_rollouts_soft", (RESULTS_MD,)),
    ("validation", "opd − sft_rollouts", (RESULTS_MD, README)),  # the no-replay hard-label control
    ("mtbench", "opd − sft_rollouts", (RESULTS_MD,)),
    ("validation", "sft_rollouts − sft", (RESULTS_MD,)),
]


@pytest.mark.parametrize(("dataset", "name", "docs"), QUOTED, ids=[f"{d}: {n}" for d, n, _ in QUOTED])
def test_each_quoted_interval_is_recomputed_from_the_raw_files(
    dataset: str, name: str, docs: tuple[str, ...]
) -> None:
    number = study_number(str(STUDY), dataset, name)
    for doc in docs:
        assert number in doc, f"{dataset} {name}: the files give {number}, which the document does not quote"


def test_the_regime_and_p7_quoted_are_the_files():
    regime = json.loads((STUDY / "regime_opd_s0.json").read_text())
    share = f"{100 * regime['share_with_rejection']:.1f}%"
    assert share in RESULTS_MD and share in README
    assert f"{regime['mean_accepted']:.2f}" in RESULTS_MD
    p7 = json.loads((REPO / "results" / "bench" / "P7.json").read_text())
    quoted = " / ".join(f"{p7['value'][c]:.2f}x" for c in ("1", "4", "16"))
    assert quoted in README


def test_the_summary_block_in_results_md_is_the_files():
    """docs/results.md holds the study's summary tables verbatim as compare renders them from the raw files."""
    block = render_summary(compare_study(STUDY))
    assert block in RESULTS_MD, (
        "docs/results.md's summary block is not the files' numbers: run "
        "`python -m draft_opd_ray.compare results/default_controls --into docs/results.md`"
    )


COPIES = {
    "validation": {"6", "9", "25", "46", "61", "71"}
}  # validation prompts with a copy among the train prompts


@pytest.mark.parametrize(
    "name", ["opd − sft", "opd − sft_rollouts", "opd − sft_rollouts_soft", "opd − branch"]
)
def test_the_sensitivity_analysis_quoted_is_the_files(name: str) -> None:
    """results.md's numbers without the validation prompts that have a copy in the training data."""
    number = study_number(str(STUDY), "validation", name, exclude=COPIES)
    assert f"{name.replace('branch', 'warm start')} {number}" in " ".join(RESULTS_MD.split())


def test_the_primary_endpoint_is_quoted_with_both_intervals_everywhere():
    """The declared rule reads two intervals (prompts clustered, over seeds): the README, results.md and the P1
    line quote both as the files give them, and P1 beside them."""
    found = compare_study(STUDY)["sets"]["validation"]
    primary = next(c for c in found["comparisons"] if c["endpoint"] == "primary")
    clustered = comparison_cell(primary)
    over_seeds = interval(primary["seed_level"], "+.3f")
    p1 = ratio_cell(next(r for r in found["ratios"] if r["endpoint"] == "primary"))
    for doc in (RESULTS_MD, README, BENCHMARKS):
        assert clustered in doc and over_seeds in doc and p1 in doc


@pytest.mark.parametrize("name", ["opd − sft_rollouts", "opd − sft_rollouts_soft"])
def test_the_controls_verdict_is_quoted_with_both_intervals(name: str) -> None:
    """C5's verdict reads the primary endpoint's two intervals for Draft-OPD minus each no-replay control:
    results.md quotes both, on both sets, as the files give them; the README's five-line summary quotes the
    hard-label control on validation."""
    found = compare_study(STUDY)["sets"]
    for set_name in ("validation", "mtbench"):
        c = next(c for c in found[set_name]["comparisons"] if c["name"] == name)
        quoting = (
            (RESULTS_MD, README)
            if (set_name, name) == ("validation", "opd − sft_rollouts")
            else (RESULTS_MD,)
        )
        for doc in quoting:
            flat = " ".join(doc.split())
            assert comparison_cell(c) in flat and interval(c["seed_level"], "+.3f") in flat, (set_name, name)
