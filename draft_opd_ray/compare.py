"""Compare drafts: `python -m draft_opd_ray.compare RESULTS_DIR | RUN_DIR... [--baseline ARM] [--out DIR]
[--dataset NAME] [--into DOC] [--exclude SET:KEYS]`.

A results dir (`results/<study>/`, with `study.json`; the format is in `results/README.md` and
`draft_opd_ray.eval.results`) holds the raw per-prompt counts of every draft on every prompt set. Per set: each
arm's τ over seeds (per seed, and the mean with its prompt-clustered 95% CI), training FLOPs; every arm against
the branch point and against the baseline arm, paired per prompt and seed, with the prompt-clustered CI, the
seed-level t-interval beside it and in words whether each excludes zero; τ ratios (P1) with CIs. The primary
endpoint named in `study.json` is marked, every other comparison is exploratory. Prints the tables and writes
`compare.md` and `compare.json` to ``--out`` (default: the results dir itself, where they are committed beside
the raw files), ending with a summary of every set side by side between markers: ``--into docs/results.md``
rewrites that block in the document, which a test holds to the files. The statistics are
`draft_opd_ray.eval.stats`'s (its docstring says why these intervals).

A run dir holds `eval/report.json` (plus Hydra's `.hydra/{config,overrides}.yaml` and `metrics.jsonl`); a Hydra
multirun dir expands to the run dirs directly inside it. Runs are grouped into arms by their Hydra overrides
without `seed=` and `hydra.*`. Per arm: τ mean with a 95% t-interval over seeds, the per-seed τ, the mean gain
over the draft the runs started from, training FLOPs, and the paired per-prompt difference against the baseline
arm (runs of the same seed on the same prompts; prompt-clustered CI over the seeds, the seed-level interval
beside it). Writes `compare.md` (also printed), `compare.json`, `tau_by_arm.png` and `tau_vs_compute.png` to
``--out`` (default `./compare_out`).

Bad input exits with code 2 and one `error: ...` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from draft_opd_ray.checkpoint import write_text_atomic
from draft_opd_ray.compare_results import interval, run_study, write_summary_into
from draft_opd_ray.errors import DataError
from draft_opd_ray.eval.results import STUDY, is_study_dir
from draft_opd_ray.eval.stats import mean_ci, paired_over_seeds
from draft_opd_ray.metrics import finite, read_metrics

EXIT_BAD_INPUT = 2
REPORT = Path("eval") / "report.json"
CURVE = Path("eval") / "curve.json"


@dataclass
class Run:
    """One run dir, read: its arm, seed, report, training FLOPs and (optional) τ-vs-FLOPs curve."""

    path: Path
    arm: str
    seed: int
    report: dict[str, Any]
    flops: float | None = None
    curve: list[dict[str, float]] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # empty when the run dir names its arm (an `arm` file)


# ------------------------------------------------------------------------------------------------ reading


def is_run_dir(path: Path) -> bool:
    return (path / REPORT).is_file()


def _natural_key(path: Path) -> tuple[int, str]:
    """Hydra's job dirs (`0_...`, `1_...`, `10_...`) in job order, anything else by name after them."""
    m = re.match(r"(\d+)", path.name)
    return (int(m.group(1)) if m else sys.maxsize, path.name)


def find_runs(paths: Sequence[str | Path]) -> list[Path]:
    """The run dirs the arguments name: each a run dir, or a multirun dir whose subdirectories are run dirs."""
    found: list[Path] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise DataError(f"{p}: does not exist")
        if is_run_dir(p):
            found.append(p)
            continue
        subs = [d for d in p.iterdir() if d.is_dir() and is_run_dir(d)] if p.is_dir() else []
        if not subs:
            raise DataError(f"{p}: not a run directory (no {REPORT}) nor a results dir (no {STUDY})")
        found += sorted(subs, key=_natural_key)
    unique: dict[Path, Path] = {}
    for p in found:
        unique.setdefault(p.resolve(), p)
    return list(unique.values())


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _load(path: Path, read: Callable[[Path], Any], default: Any) -> Any:
    """``read(path)``, ``default`` if the file is absent; `DataError` with one line if it does not parse."""
    if not path.is_file():
        return default
    try:
        return read(path)
    except (ValueError, yaml.YAMLError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"{path}: does not parse ({first})") from None


def arm_name(overrides: Sequence[str]) -> str:
    """The overrides that define an arm: all but `seed=` and `hydra.*`, joined by ","; "default" if none."""

    def key(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0]

    kept = [o for o in overrides if key(o) != "seed" and not key(o).startswith(("hydra.", "hydra/"))]
    return ",".join(kept) or "default"


def train_flops(rows: Sequence[dict[str, Any]]) -> float | None:
    """`flops_draft` + `flops_target` of the last metrics row that has them; None if no row does."""
    for row in reversed(rows):
        if "flops_draft" in row or "flops_target" in row:
            return float(row.get("flops_draft", 0.0)) + float(row.get("flops_target", 0.0))
    return None


def load_run(path: Path) -> Run:
    report = _load(path / REPORT, _read_json, None)
    if not isinstance(report, dict) or not isinstance(report.get("datasets"), dict):
        raise DataError(f"{path / REPORT}: not an eval report (no 'datasets')")
    overrides = _load(path / ".hydra" / "overrides.yaml", _read_yaml, []) or []
    config = _load(path / ".hydra" / "config.yaml", _read_yaml, {})
    seed = config.get("seed", 0) if isinstance(config, dict) else 0
    named, listed = (path / "arm").is_file(), [str(o) for o in overrides]
    return Run(
        path=path,
        arm=(path / "arm").read_text().strip() if named else arm_name(listed),
        overrides=[] if named else listed,
        seed=int(seed or 0),
        report=report,
        flops=train_flops(_load(path / "metrics.jsonl", read_metrics, [])),
        curve=list(_load(path / CURVE, _read_json, []) or []),
    )


# ------------------------------------------------------------------------------------------------ numbers


def _entry(run: Run, dataset: str) -> dict[str, Any]:
    datasets = run.report["datasets"]
    if dataset not in datasets:
        raise DataError(f"{run.path / REPORT}: no dataset {dataset!r} (has: {', '.join(datasets) or 'none'})")
    e = datasets[dataset]
    if not isinstance(e, dict) or "tau" not in e:
        raise DataError(f"{run.path / REPORT}: dataset {dataset!r} has no 'tau'")
    return e


def _run_row(run: Run, dataset: str) -> dict[str, Any]:
    e = _entry(run, dataset)
    before = (e.get("before") or {}).get("tau")
    return {
        "path": str(run.path),
        "arm": run.arm,
        "seed": run.seed,
        "tau": float(e["tau"]),
        "tau_before": None if before is None else float(before),
        "n": e.get("n", len(e.get("per_prompt", []))),
        "flops": run.flops,
    }


def paired_vs(runs: Sequence[Run], base: Sequence[Run], dataset: str) -> dict[str, Any] | None:
    """Per-prompt τ differences of ``runs`` minus the ``base`` run of the same seed, over the seeds
    (`draft_opd_ray.eval.stats.paired_over_seeds`: mean over prompts of the mean over seeds, prompt-clustered
    CI, ``seed_level`` and ``naive`` intervals), the seeds paired, and the seeds left unpaired (no base run of
    that seed, no `per_prompt` lists of equal length, or other prompts than the first paired seed's). None if
    no run could be paired."""
    by_seed: dict[int, Run] = {}
    for run in base:
        by_seed.setdefault(run.seed, run)
    mine: list[Any] = []
    theirs: list[Any] = []
    seeds: list[int] = []
    unpaired: list[int] = []
    for r in runs:
        b = by_seed.get(r.seed)
        pa = _entry(r, dataset).get("per_prompt")
        pb = _entry(b, dataset).get("per_prompt") if b is not None else None
        if not pa or not pb or len(pa) != len(pb) or (mine and len(pa) != len(mine[0])):
            unpaired.append(r.seed)
            continue
        mine.append(pa)
        theirs.append(pb)
        seeds.append(r.seed)
    if not seeds:
        return None
    return {**paired_over_seeds(mine, theirs), "seeds": seeds, "unpaired_seeds": unpaired}


def compare(
    runs: Sequence[Run], *, dataset: str | None = None, baseline: str | None = None
) -> dict[str, Any]:
    """The comparison's numbers (what `compare.json` holds)."""
    dataset = dataset or next(iter(runs[0].report["datasets"]), None)
    if dataset is None:
        raise DataError(f"{runs[0].path / REPORT}: no dataset in the report")
    arms: dict[str, list[Run]] = {}
    for r in runs:
        arms.setdefault(r.arm, []).append(r)
    baseline = baseline or next(iter(arms))
    if baseline not in arms:
        raise DataError(f"--baseline {baseline!r}: no such arm (arms: {'; '.join(arms)})")
    rows = [_run_row(r, dataset) for r in runs]
    out: dict[str, Any] = {"dataset": dataset, "baseline": baseline, "arms": {}, "runs": rows}
    for arm, members in arms.items():
        mine = [row for row in rows if row["arm"] == arm]
        gains = [row["tau"] - row["tau_before"] for row in mine if row["tau_before"] is not None]
        flops = [row["flops"] for row in mine if row["flops"] is not None]
        out["arms"][arm] = {
            "seeds": [row["seed"] for row in mine],
            "tau": mean_ci([row["tau"] for row in mine]),
            "tau_per_seed": [row["tau"] for row in mine],
            "gain_over_before": mean_ci(gains) if gains else None,
            "flops": float(np.mean(flops)) if flops else None,
            "vs_baseline": None if arm == baseline else paired_vs(members, arms[baseline], dataset),
        }
    return out


# ------------------------------------------------------------------------------------------------ output


def _signed_ci(c: dict[str, float]) -> str:
    """``+0.031 [+0.012, +0.050]``, or only the mean when there is a single value."""
    if c["n"] == 1:
        return f"{c['mean']:+.3f} (n=1)"
    return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"


def render_table(result: dict[str, Any]) -> str:
    base = result["baseline"]
    lines = [
        f"# Comparison on {result['dataset']} (baseline arm: {base})",
        "",
        f"| arm | seeds | τ mean [95% CI] | τ per seed | τ after − before | train FLOPs | Δτ vs {base} per prompt "
        "[95% CI, prompts clustered] | over seeds [95% t-CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, a in result["arms"].items():
        t = a["tau"]
        per_seed = ", ".join(f"s{s}: {v:.3f}" for s, v in zip(a["seeds"], a["tau_per_seed"]))
        gain = _signed_ci(a["gain_over_before"]) if a["gain_over_before"] else "-"
        flops = f"{a['flops']:.3g}" if a["flops"] is not None else "-"
        v = a["vs_baseline"]
        if arm == base:
            vs, over = "(baseline)", ""
        elif v is None:
            vs, over = "- (no runs of the same seed on the same prompts)", ""
        else:
            vs = f"{_signed_ci(v)} ({v['prompts']} prompts × {len(v['seeds'])} seeds)"
            over = interval(v["seed_level"], "+.3f")
        lines.append(
            f"| {arm} | {t['n']} | {t['mean']:.3f} [{t['lo']:.3f}, {t['hi']:.3f}] | {per_seed} | {gain} | "
            f"{flops} | {vs} | {over} |"
        )
    return "\n".join(lines) + "\n"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tau_by_arm(result: dict[str, Any], out: Path) -> Path:
    """τ per arm: mean with its CI as error bar, each seed's τ as a dot."""
    plt = _pyplot()
    arms = list(result["arms"])
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(arms) + 2), 3.5))
    for i, arm in enumerate(arms):
        t = result["arms"][arm]["tau"]
        ax.errorbar([i], [t["mean"]], yerr=[[t["mean"] - t["lo"]], [t["hi"] - t["mean"]]], fmt="o", capsize=5)
        seeds = result["arms"][arm]["tau_per_seed"]
        ax.scatter(i + 0.12 + np.linspace(-0.04, 0.04, len(seeds)), seeds, s=12, color="grey", zorder=3)
    ax.set_xticks(range(len(arms)), arms, rotation=20, ha="right", fontsize=8)
    ax.set_xlim(-0.5, len(arms) - 0.5)
    ax.set_ylabel(f"τ on {result['dataset']} (held-out prompts)")
    ax.set_title("τ by arm: mean, 95% CI over seeds, seeds as dots", fontsize=9)
    fig.tight_layout()
    path = out / "tau_by_arm.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_tau_vs_compute(runs: Sequence[Run], result: dict[str, Any], out: Path) -> Path | None:
    """τ vs training FLOPs, every arm on one figure: one point per run, and each run's `eval/curve.json` as
    a line. None (nothing written) when no run has FLOPs or a curve."""
    if not any(r.flops is not None or r.curve for r in runs):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    colors = {arm: f"C{i % 10}" for i, arm in enumerate(result["arms"])}
    labelled: set[str] = set()
    for run, row in zip(runs, result["runs"]):
        color = colors[run.arm]
        label = None if run.arm in labelled else run.arm
        if run.curve:
            pts = sorted((float(p["flops"]), float(p["tau"])) for p in run.curve)
            ax.plot(*zip(*pts), color=color, alpha=0.5, lw=1, label=label)
            label = None
        if run.flops is not None:
            ax.scatter([run.flops], [row["tau"]], color=color, s=20, zorder=3, label=label)
        labelled.add(run.arm)
    xs = [x for line in ax.get_lines() for x in line.get_xdata()] + [r.flops for r in runs if r.flops]
    if xs and min(xs) > 0:
        ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (draft + target)")
    ax.set_ylabel(f"τ on {result['dataset']} (held-out prompts)")
    ax.set_title("τ vs training compute")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "tau_vs_compute.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def distinct_arms(runs: Sequence[Run]) -> list[Run]:
    """Arm names from the overrides that differ between runs: those every run shares (the target, the draft,
    a sweep's fixed settings) name no arm."""
    listed = [r for r in runs if r.overrides]
    shared = set.intersection(*(set(r.overrides) for r in listed)) if len(listed) > 1 else set()
    return [
        dataclasses.replace(r, arm=arm_name([o for o in r.overrides if o not in shared]))
        if r.overrides
        else r
        for r in runs
    ]


def run_compare(
    paths: Sequence[str | Path], *, out: str | Path, dataset: str | None = None, baseline: str | None = None
) -> dict[str, Any]:
    """Read the runs, compute, write `compare.{md,json}` and the plots to ``out``; returns the numbers."""
    runs = distinct_arms([load_run(p) for p in find_runs(paths)])
    result = compare(runs, dataset=dataset, baseline=baseline)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = render_table(result)
    write_text_atomic(out / "compare.md", table)
    write_text_atomic(out / "compare.json", json.dumps(finite(result), indent=2, allow_nan=False) + "\n")
    plot_tau_by_arm(result, out)
    plot_tau_vs_compute(runs, result, out)
    print(table, end="", flush=True)
    return result


def parse_exclude(specs: Sequence[str]) -> dict[str, set[str]]:
    """``["validation:6,9", "mtbench:3"]`` -> ``{"validation": {"6", "9"}, "mtbench": {"3"}}``."""
    out: dict[str, set[str]] = {}
    for spec in specs:
        name, _, keys = spec.partition(":")
        got = {k.strip() for k in keys.split(",") if k.strip()}
        if not name or not got:
            raise DataError(f"--exclude {spec!r}: expected SET:KEY[,KEY...], e.g. validation:6,9")
        out.setdefault(name, set()).update(got)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m draft_opd_ray.compare", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="DIR",
        help="one results dir (with study.json), or run dirs / Hydra multirun dirs",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        metavar="ARM",
        help="arm to compare against (default: study.json's, or the first)",
    )
    parser.add_argument(
        "--out", default=None, metavar="DIR", help="output dir (default: the results dir, or ./compare_out)"
    )
    parser.add_argument(
        "--dataset", default=None, metavar="NAME", help="eval set (default: all, or the first)"
    )
    parser.add_argument(
        "--into",
        default=None,
        metavar="DOC",
        help="results dir only: also rewrite the study's summary block in this markdown file (docs/results.md)",
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="SET:KEYS",
        help="results dir only: leave out these prompt keys of a set (e.g. validation:6,9,25), a sensitivity "
        "analysis; printed, written only to --out",
    )
    args = parser.parse_args(argv)
    try:
        if len(args.runs) == 1 and is_study_dir(Path(args.runs[0])):
            exclude = parse_exclude(args.exclude)
            if exclude and args.into:
                raise DataError("--into writes the study's own summary: not with --exclude")
            result = run_study(
                args.runs[0], out=args.out, baseline=args.baseline, dataset=args.dataset, exclude=exclude
            )
            if args.into:
                write_summary_into(args.into, result)
                print(
                    f"[compare] wrote the summary of {result['study']['name']} into {args.into}",
                    file=sys.stderr,
                )
        elif args.into:
            raise DataError("--into rewrites a study's summary: give one results dir (with study.json)")
        else:
            out = args.out or "compare_out"
            run_compare(args.runs, out=out, dataset=args.dataset, baseline=args.baseline)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
