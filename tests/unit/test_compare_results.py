"""`python -m draft_opd_ray.compare results/<study>` on a small results dir written in the committed format: every
printed number (τ per seed and over seeds, each comparison's prompt-clustered, seed-level and naive intervals and
their verdicts in words, P1) equals a plain computation here; the primary endpoint is marked, the rest labelled
exploratory; bad files are one `error:` line and exit code 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats as sps

from draft_opd_ray.compare import main
from draft_opd_ray.compare_results import study_number
from draft_opd_ray.eval.stats import bootstrap_indices

STUDY = {
    "name": "toy",
    "question": "does opd beat sft at matched FLOPs?",
    "primary": {"set": "validation", "arm": "opd", "baseline": "sft"},
    "baseline": "sft",
    "notes": "",
}
# (steps, accepted) per prompt, per seed; validation: 5 prompts x 3 seeds, mtbench: 4 prompts x 2 seeds
VALIDATION = {
    "branch": [[(10, 4), (8, 2), (12, 6), (9, 3), (11, 1)]],
    "sft": [
        [(10, 5), (8, 3), (12, 7), (9, 4), (11, 2)],
        [(10, 6), (8, 2), (12, 8), (9, 3), (11, 3)],
        [(10, 5), (8, 4), (12, 6), (9, 4), (11, 2)],
    ],
    "opd": [
        [(10, 7), (8, 4), (12, 9), (9, 5), (11, 3)],
        [(10, 8), (8, 3), (12, 9), (9, 6), (11, 4)],
        [(10, 6), (8, 5), (12, 10), (9, 4), (11, 2)],
    ],
}
MTBENCH = {  # prompt 3 took no verification step in opd seed 1: that (prompt, seed) cell drops out
    "branch": [[(6, 2), (7, 3), (5, 1), (8, 4)]],
    "sft": [[(6, 3), (7, 3), (5, 2), (8, 4)], [(6, 2), (7, 4), (5, 2), (8, 5)]],
    "opd": [[(6, 3), (7, 5), (5, 2), (8, 3)], [(6, 4), (7, 4), (5, 3), (0, 0)]],
}


def write_study(root: Path) -> Path:
    """The results dir in the format of `results/README.md`, written field by field (not by the module)."""
    root.mkdir(parents=True)
    (root / "study.json").write_text(json.dumps(STUDY))
    for set_name, arms in (("validation", VALIDATION), ("mtbench", MTBENCH)):
        (root / set_name).mkdir()
        for arm, seeds in arms.items():
            for s, prompts in enumerate(seeds):
                seed = None if arm == "branch" else s
                data = {
                    "arm": arm,
                    "seed": seed,
                    "set": set_name,
                    "k": 4,
                    "max_new_tokens": 256,
                    "flops": None if seed is None else 2.5e14,
                    "tokens": None if seed is None else 160000,
                    "command": f"python bench/study.py arm {arm} --seed {s}",
                    "eval_command": "python bench/study.py eval",
                    "commit": "0123abc",
                    "draft": f"{arm}_s{s}",
                    "prompts": [
                        {"key": str(i), "steps": st, "accepted": a} for i, (st, a) in enumerate(prompts)
                    ],
                }
                label = "branch" if seed is None else f"{arm}_s{seed}"
                (root / set_name / f"{label}.json").write_text(json.dumps(data))
    return root


# ------------------------------------------------------------------------------------------------ brute force


def pct(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 2.5)), float(np.percentile(samples, 97.5))


def pooled(seed: list[tuple[int, int]], rows: Any) -> float:
    """Pooled τ of one seed on the prompts ``rows``; NaN without a step (that seed then sits out the mean)."""
    steps = sum(seed[p][0] for p in rows)
    return 1 + sum(seed[p][1] for p in rows) / steps if steps else math.nan


def grid(a: list[list[tuple[int, int]]], b: list[list[tuple[int, int]]]) -> list[list[float]]:
    """d[p][s] = τ_a − τ_b, NaN where either side took no step; a one-draft side stands against every seed."""
    b = b * len(a) if len(b) == 1 else b
    return [
        [
            (1 + x[p][1] / x[p][0]) - (1 + y[p][1] / y[p][0]) if x[p][0] and y[p][0] else math.nan
            for x, y in zip(a, b)
        ]
        for p in range(len(a[0]))
    ]


def t_interval(values: list[float]) -> tuple[float, float]:
    half = sps.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    return float(np.mean(values) - half), float(np.mean(values) + half)


def words(lo: float, hi: float, null: float = 0.0) -> str:
    what = "zero" if null == 0 else "1"
    return (
        f"excludes {what} (above)"
        if lo > null
        else f"excludes {what} (below)"
        if hi < null
        else f"includes {what}"
    )


def comparison_row(name: str, endpoint: str, d: list[list[float]]) -> str:
    """The table row of one comparison, every number computed here."""
    rows = [[x for x in r if not math.isnan(x)] for r in d]
    means = [sum(r) / len(r) for r in rows if r]
    lo, hi = pct([np.mean([means[i] for i in row]) for row in bootstrap_indices(len(means))])
    seed_means = [float(np.mean([x for x in col if not math.isnan(x)])) for col in zip(*d)]
    s_lo, s_hi = t_interval(seed_means)
    flat = [x for r in d for x in r if not math.isnan(x)]
    n_lo, n_hi = pct([np.mean([flat[i] for i in row]) for row in bootstrap_indices(len(flat))])
    return (
        f"| {name} | {endpoint} | {len(means)} prompts × {len(d[0])} seeds | {np.mean(means):+.3f} "
        f"[{lo:+.3f}, {hi:+.3f}] | {words(lo, hi)} | {', '.join(f'{m:+.3f}' for m in seed_means)} | "
        f"[{s_lo:+.3f}, {s_hi:+.3f}] | {words(s_lo, s_hi)} | [{n_lo:+.3f}, {n_hi:+.3f}] |"
    )


def arm_row(arm: str, seeds: list[list[tuple[int, int]]]) -> str:
    every = range(len(seeds[0]))
    taus = [pooled(s, every) for s in seeds]
    lo, hi = pct([np.mean([pooled(s, row) for s in seeds]) for row in bootstrap_indices(len(seeds[0]))])
    per_seed = ", ".join(f"s{i} {t:.3f}" for i, t in enumerate(taus))
    t_lo, t_hi = t_interval(taus)
    return (
        f"| {arm} | {len(seeds[0])} prompts × {len(seeds)} seeds | {per_seed} | {np.mean(taus):.3f} "
        f"[{lo:.3f}, {hi:.3f}] | [{t_lo:.3f}, {t_hi:.3f}] | 2.5e+14 |"
    )


def ratio(a: list[list[tuple[int, int]]], b: list[list[tuple[int, int]]]) -> tuple[float, float, float]:
    every = range(len(a[0]))
    value = np.mean([pooled(s, every) for s in a]) / np.mean([pooled(s, every) for s in b])
    boot = [
        np.nanmean([pooled(s, row) for s in a]) / np.nanmean([pooled(s, row) for s in b])
        for row in bootstrap_indices(len(a[0]))
    ]
    return float(value), *pct(boot)


def compare_cli(root: Path) -> subprocess.CompletedProcess[str]:
    """`python -m draft_opd_ray.compare <root>` as a user runs it; it must succeed."""
    run = subprocess.run(
        [sys.executable, "-m", "draft_opd_ray.compare", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    return run


# ------------------------------------------------------------------------------------------------ tests


def test_printed_tables_equal_a_plain_computation(tmp_path: Path) -> None:
    root = write_study(tmp_path / "results" / "toy")
    run = compare_cli(root)
    out = run.stdout
    v, m = VALIDATION, MTBENCH
    primary = comparison_row("opd − sft", "**primary**", grid(v["opd"], v["sft"]))
    assert primary in out
    assert comparison_row("opd − branch", "exploratory", grid(v["opd"], v["branch"])) in out
    assert comparison_row("sft − branch", "exploratory", grid(v["sft"], v["branch"])) in out
    mt = comparison_row("opd − sft", "exploratory", grid(m["opd"], m["sft"]))
    assert mt in out and "| 4 prompts × 2 seeds |" in mt  # prompt 3 keeps its seed-0 difference
    assert arm_row("opd", v["opd"]) in out and arm_row("sft", m["sft"]) in out
    p1, p1_lo, p1_hi = ratio(v["opd"], v["sft"])
    p1_cell = f"{p1:.3f} [{p1_lo:.3f}, {p1_hi:.3f}]"
    assert f"| P1 = τ(opd) / τ(sft) | **primary** | 5 | {p1_cell} | {words(p1_lo, p1_hi, 1)} |" in out
    r, lo, hi = ratio(m["opd"], m["sft"])
    assert f"| τ(opd) / τ(sft) | exploratory | 4 | {r:.3f} [{lo:.3f}, {hi:.3f}] |" in out

    # the primary endpoint is stated once above the tables; every other comparison is exploratory
    cell = primary.split(" | ")[3]
    assert "opd − sft per prompt on validation" in out and f"**{cell}** (5 prompts × 3 seeds)" in out
    over_seeds, over_words = primary.split(" | ")[6:8]  # the seed-level t-interval, beside it in the headline
    assert f"{over_seeds}, {over_words}." in out.split("\n")[2]
    assert out.count("| **primary** |") == 2 and out.count("| exploratory |") == 6  # 5 comparisons + 1 ratio
    assert out.index("## validation") < out.index("## mtbench")  # the primary endpoint's set first
    assert "| branch | 5 prompts × 1 draft (no seed) |" in out

    assert (root / "compare.md").read_text() == out
    numbers = json.loads((root / "compare.json").read_text())
    assert numbers["sets"]["validation"]["comparisons"][0]["seed_ids"] == [0, 1, 2]
    assert study_number(root, "validation", "opd - sft") == cell  # one line per published number
    assert study_number(root, "validation", "P1") == p1_cell


def test_rerunning_reproduces_the_written_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_study(tmp_path / "toy")
    main([str(root)])
    first = (root / "compare.md").read_text()
    main(
        [str(root), "--out", str(tmp_path / "again")]
    )  # compare.{md,json} in the dir are not read as results
    assert (tmp_path / "again" / "compare.md").read_text() == first
    main([str(root), "--dataset", "mtbench", "--baseline", "branch", "--out", str(tmp_path / "o")])
    table = (tmp_path / "o" / "compare.md").read_text()
    assert "## validation" not in table and "| sft − branch | exploratory |" in table
    capsys.readouterr()


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


def _edit(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("file", "changes", "message"),
    [
        ("study.json", {"baseline": None}, "study.json: 'baseline' must be str, got None"),
        (
            "validation/opd_s1.json",
            {"seed": 4},
            "opd_s1.json: the file of arm 'opd', seed 4 must be named opd_s4",
        ),
        (
            "validation/branch.json",
            {"seed": 0},
            "branch.json: the file of arm 'branch', seed 0 must be named",
        ),
        ("validation/sft_s0.json", {"set": "mtbench"}, "sft_s0.json: 'set' is 'mtbench' but the file is in"),
        ("validation/sft_s0.json", {"k": "4"}, "sft_s0.json: 'k' must be int, got '4'"),
        ("validation/sft_s0.json", {"k": 8}, "sft_s0.json has k=8, max_new_tokens=256; branch.json has k=4"),
        (
            "validation/sft_s0.json",
            {"prompts": [{"key": "9", "steps": 1, "accepted": 0}]},
            "sft_s0.json and branch.json hold different prompt keys",
        ),
        (
            "validation/sft_s0.json",
            {"prompts": [{"key": "0", "steps": -1, "accepted": 0}]},
            "prompts[0]: negative counts",
        ),
        ("validation/sft_s0.json", {"prompts": []}, "sft_s0.json: 'prompts' is empty"),
    ],
)
def test_bad_results_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], file: str, changes: dict[str, Any], message: str
) -> None:
    root = write_study(tmp_path / "toy")
    _edit(root / file, **changes)
    err = _fails([str(root)], capsys)
    assert err.startswith("error: ") and message in err


def test_notes_are_optional(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_study(tmp_path / "toy")
    (root / "study.json").write_text(json.dumps({k: v for k, v in STUDY.items() if k != "notes"}))
    main([str(root)])
    assert capsys.readouterr().out.startswith("# toy: does opd beat sft at matched FLOPs?\n")


def test_a_dir_that_is_neither_results_nor_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_study(tmp_path / "toy")
    (root / "study.json").write_text("{not json")
    assert "study.json: does not parse" in _fails([str(root)], capsys)
    (root / "study.json").unlink()
    assert "no study.json" in _fails([str(root)], capsys)


def test_the_primary_arm_meets_each_other_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A third arm (a control beside the baseline) is compared with the primary endpoint's arm, exploratory."""
    ctrl = [[(10, 6), (8, 5), (12, 8), (9, 5), (11, 4)], [(10, 7), (8, 4), (12, 7), (9, 5), (11, 3)]]
    monkeypatch.setitem(VALIDATION, "ctrl", ctrl)
    root = write_study(tmp_path / "results" / "toy")
    run = compare_cli(root)
    paired = "| 5 prompts × 2 seeds (unpaired seeds: [2]) |"  # opd and sft have a seed 2, ctrl has not
    for arm, against in (("opd", "ctrl"), ("ctrl", "sft")):
        row = comparison_row(
            f"{arm} − {against}", "exploratory", grid(VALIDATION[arm][:2], VALIDATION[against][:2])
        )
        assert row.replace("| 5 prompts × 2 seeds |", paired) in run.stdout
    assert "| sft − ctrl |" not in run.stdout  # only the primary arm meets the other controls


def test_one_seed_says_it_has_no_interval_over_seeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one seed a side, the headline says there is no seed-level interval instead of printing a bare mean."""
    for arm in ("opd", "sft"):
        monkeypatch.setitem(VALIDATION, arm, VALIDATION[arm][:1])
    root = write_study(tmp_path / "results" / "toy")
    run = compare_cli(root)
    headline = run.stdout.split("\n")[2]
    assert "(5 prompts × 1 seed)" in headline and "; one seed, so no interval over seeds." in headline


def test_the_summary_block_is_the_tables_side_by_side_and_rewrites_a_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary's cells are the per-set tables' cells (both sets in one row), and `--into` rewrites only the
    study's block in a document; a document without the block is one error line."""
    root = write_study(tmp_path / "toy")
    doc = tmp_path / "results.md"
    begin = "<!-- compare summary: toy (generated: python -m draft_opd_ray.compare results/toy) -->"
    doc.write_text(f"# before\n\n{begin}\nstale numbers\n<!-- end of compare summary -->\n\n## after\n")
    main([str(root), "--into", str(doc)])
    out = capsys.readouterr().out
    text = doc.read_text()
    assert text.startswith("# before\n\n" + begin) and text.endswith(
        "<!-- end of compare summary -->\n\n## after\n"
    )
    block = text[text.index(begin) :]
    assert "stale numbers" not in block and block[: block.index("\n\n## after")] + "\n" in out  # as printed
    v, m = VALIDATION, MTBENCH
    for name, a, b in (("opd − sft", "opd", "sft"), ("opd − branch", "opd", "branch")):
        cells = [comparison_row(name, "x", grid(v[a], v[b])).split(" | "), None]
        cells[1] = comparison_row(name, "x", grid(m[a], m[b])).split(" | ")
        # per set: prompts × seeds, the prompt-clustered cell with its words, the seed-level interval with its words
        want = []
        for c in cells:
            prompts, seeds = c[2].split(" prompts × ")
            want += [f"{prompts} × {seeds.split(' ')[0]}", f"{c[3]}, {c[4]}", f"{c[6]}, {c[7]}"]
        label = f"{name} (**primary**, validation)" if name == "opd − sft" else name
        assert f"| {label} | {' | '.join(want)} |" in block
    sft = [arm_row("sft", v["sft"]).split(" | "), arm_row("sft", m["sft"]).split(" | ")]
    assert f"| sft | 2.5e+14 | {sft[0][2]} | {sft[0][3]} | {sft[1][2]} | {sft[1][3]} |" in block

    doc.write_text("# no block here\n")
    assert "no block from" in _fails([str(root), "--into", str(doc)], capsys)
    assert doc.read_text() == "# no block here\n"


def test_exclude_is_the_study_without_those_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--exclude validation:1,3` (a sensitivity analysis) prints what the same study without prompts 1 and 3
    prints, says so at the top, and leaves the dir's own compare.md alone; an unknown set or key is an error."""
    root = write_study(tmp_path / "full" / "toy")
    main([str(root)])
    own = (root / "compare.md").read_text()
    capsys.readouterr()
    main([str(root), "--exclude", "validation:1", "--exclude", "validation:3"])
    out = capsys.readouterr().out
    assert (root / "compare.md").read_text() == own
    assert out.startswith(
        "# toy: does opd beat sft at matched FLOPs?\n\n**Sensitivity analysis: validation without "
        "prompts 1, 3** (`--exclude`).\n"
    )
    for arm, seeds in VALIDATION.items():
        monkeypatch.setitem(VALIDATION, arm, [[c for i, c in enumerate(s) if i not in (1, 3)] for s in seeds])
    smaller = write_study(tmp_path / "small" / "toy")
    main([str(smaller)])
    # the same tables: prompt keys differ (0, 2, 4 against 0, 1, 2) but no number depends on them
    assert out.split("\n", 4)[4] == capsys.readouterr().out.split("\n", 2)[2]
    assert "no prompt key 9" in _fails([str(root), "--exclude", "validation:2,9"], capsys)
    assert "no set 'test'" in _fails([str(root), "--exclude", "test:1"], capsys)
    assert "expected SET:KEY" in _fails([str(root), "--exclude", "validation"], capsys)
