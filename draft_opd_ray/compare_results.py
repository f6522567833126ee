"""The tables of a results dir (`results/<study>/`, format in `draft_opd_ray.eval.results`), recomputed from its
raw per-prompt counts: what `python -m draft_opd_ray.compare results/<study>` prints and writes as `compare.md`
and `compare.json`.

Per set (the primary endpoint's first): each arm's τ over seeds; every arm against the baseline arm, the
primary endpoint's arm against each other control, every arm against the branch point, paired per prompt and
seed, with the prompt-clustered CI, the seed-level t-interval and the naive pooled one (`draft_opd_ray.eval.stats`, whose docstring says why), each read in words; τ ratios (P1). The
primary endpoint of `study.json` is marked, every other comparison is exploratory. `study_number` recomputes one
published cell, for tests that pin a number in the docs to its committed file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from draft_opd_ray.checkpoint import write_text_atomic
from draft_opd_ray.errors import DataError
from draft_opd_ray.eval.results import BRANCH, DraftResult, Study, load_study
from draft_opd_ray.eval.stats import arm_tau_ci, paired_over_seeds, ratio_ci
from draft_opd_ray.metrics import finite


def interval(c: dict[str, Any], fmt: str, lo: str = "lo", hi: str = "hi") -> str:
    """``[lo, hi]`` in ``fmt``; "one seed" (or "-") where the bounds are NaN."""
    if not (np.isfinite(c[lo]) and np.isfinite(c[hi])):
        return c.get("note") or "-"
    return f"[{c[lo]:{fmt}}, {c[hi]:{fmt}}]"


def in_words(c: dict[str, Any], null: float = 0.0, lo: str = "lo", hi: str = "hi") -> str:
    """Whether the interval ``[c[lo], c[hi]]`` excludes ``null`` (and on which side), in words."""
    what = "zero" if null == 0.0 else f"{null:g}"
    if not (np.isfinite(c[lo]) and np.isfinite(c[hi])):
        return c.get("note") or "no interval"
    if c[lo] > null:
        return f"excludes {what} (above)"
    if c[hi] < null:
        return f"excludes {what} (below)"
    return f"includes {what}"


def _pair(a: list[DraftResult], b: list[DraftResult]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """(a's counts, b's counts, seeds, unpaired seeds): seed s of ``a`` against seed s of ``b``; a branch point
    (one draft, no seed) against every seed of the other side."""
    if len(b) == 1 and b[0].seed is None:
        return [r.counts() for r in a], [b[0].counts()] * len(a), [r.seed for r in a], []
    if len(a) == 1 and a[0].seed is None:
        return [a[0].counts()] * len(b), [r.counts() for r in b], [r.seed for r in b], []
    theirs = {r.seed: r for r in b}
    mine = [r for r in a if r.seed in theirs]
    unpaired = sorted({r.seed for r in a} ^ set(theirs), key=lambda s: -1 if s is None else s)
    return (
        [r.counts() for r in mine],
        [theirs[r.seed].counts() for r in mine],
        [r.seed for r in mine],
        unpaired,
    )


def _endpoint(study: Study, set_name: str, arm: str, against: str) -> str:
    p = study.primary
    return "primary" if p and (p.set, p.arm, p.baseline) == (set_name, arm, against) else "exploratory"


def _set_numbers(study: Study, set_name: str, drafts: list[DraftResult], baseline: str) -> dict[str, Any]:
    """One set's arms, comparisons (each arm against the baseline arm, the primary endpoint's arm against each
    other control, then every arm against the branch point) and τ ratios (P1 where that is the primary
    endpoint)."""
    arms: dict[str, list[DraftResult]] = {}
    for r in drafts:
        arms.setdefault(r.arm, []).append(r)
    out: dict[str, Any] = {"k": drafts[0].k, "max_new_tokens": drafts[0].max_new_tokens, "arms": {}}
    for arm, members in arms.items():
        out["arms"][arm] = {
            **arm_tau_ci([r.counts() for r in members]),
            "seed_ids": [r.seed for r in members],
            "flops": [r.flops for r in members],
            "tokens": [r.tokens for r in members],
        }
    pairs = [(a, baseline) for a in arms if a not in (baseline, BRANCH) and baseline in arms]
    if study.primary:  # the arm the study is about against each of its other controls
        lead = study.primary.arm
        pairs += [(lead, a) for a in arms if a not in (lead, baseline, BRANCH)]
    pairs += [(a, BRANCH) for a in arms if a != BRANCH and BRANCH in arms]
    if study.primary and study.primary.set == set_name and study.primary.baseline != baseline:
        pairs.insert(0, (study.primary.arm, study.primary.baseline))
    out["comparisons"], out["ratios"] = [], []
    for arm, against in pairs:
        if arm not in arms or against not in arms:
            continue
        mine, theirs, seeds, unpaired = _pair(arms[arm], arms[against])
        head: dict[str, Any] = {
            "name": f"{arm} − {against}",
            "arm": arm,
            "against": against,
            "endpoint": _endpoint(study, set_name, arm, against),
            "seed_ids": seeds,
            "unpaired": unpaired,
        }
        out["comparisons"].append({**head, **(paired_over_seeds(mine, theirs) if seeds else {})})
        if against != BRANCH:
            name = f"τ({arm}) / τ({against})"
            a_counts, b_counts = [r.counts() for r in arms[arm]], [r.counts() for r in arms[against]]
            out["ratios"].append({**head, "name": name, **ratio_ci(a_counts, b_counts)})
    out["comparisons"].sort(key=lambda c: c["endpoint"] != "primary")
    return out


def exclude_prompts(
    sets: dict[str, list[DraftResult]], exclude: dict[str, set[str]]
) -> dict[str, list[DraftResult]]:
    """The sets without the prompt keys ``exclude`` names per set (a sensitivity analysis: e.g. the prompts with
    a copy in the training data); a key no draft of its set holds is an error (a typo would exclude nothing)."""
    out = dict(sets)
    for name, keys in exclude.items():
        if name not in sets:
            raise DataError(f"--exclude: no set {name!r} (has: {', '.join(sets) or 'none'})")
        have = {p.key for p in sets[name][0].prompts}
        if missing := sorted(keys - have):
            raise DataError(f"--exclude: set {name!r} has no prompt key {', '.join(missing)}")
        out[name] = [
            dataclasses.replace(r, prompts=tuple(p for p in r.prompts if p.key not in keys))
            for r in sets[name]
        ]
    return out


def compare_study(
    path: str | Path,
    *,
    baseline: str | None = None,
    dataset: str | None = None,
    exclude: dict[str, set[str]] | None = None,
) -> dict[str, Any]:
    """The numbers of a results dir (what its `compare.json` holds), without the prompts ``exclude`` names."""
    study, sets = load_study(path)
    if exclude:
        sets = exclude_prompts(sets, exclude)
    if dataset is not None:
        if dataset not in sets:
            raise DataError(f"{path}: no set {dataset!r} (has: {', '.join(sets) or 'none'})")
        sets = {dataset: sets[dataset]}
    base = baseline or study.baseline
    result: dict[str, Any] = {"study": dataclasses.asdict(study), "baseline": base, "sets": {}}
    if exclude:
        result["excluded"] = {name: sorted(keys, key=lambda k: (len(k), k)) for name, keys in exclude.items()}
    first = study.primary.set if study.primary else None
    for name, drafts in sorted(sets.items(), key=lambda kv: (kv[0] != first, kv[0])):
        result["sets"][name] = _set_numbers(study, name, drafts, base)
    return result


def _flops(values: list[float | None]) -> str:
    known = sorted({v for v in values if v is not None})
    if not known:
        return "-"
    lo, hi = f"{known[0]:.3g}", f"{known[-1]:.3g}"
    return lo if lo == hi else f"{lo}-{hi}"


def _grid_size(prompts: int, seeds: list[Any]) -> str:
    if seeds == [None]:
        return f"{prompts} prompts × 1 draft (no seed)"
    return f"{prompts} prompts × {len(seeds)} seed{'s' if len(seeds) != 1 else ''}"


def comparison_cell(c: dict[str, Any]) -> str:
    """``+0.059 [+0.024, +0.092]``: a comparison's mean and prompt-clustered CI as the tables print it."""
    return f"{c['mean']:+.3f} {interval(c, '+.3f')}" if "mean" in c else "- (no seed paired)"


def ratio_cell(r: dict[str, Any]) -> str:
    return f"{r['ratio']:.3f} {interval(r, '.3f')}"


def study_number(
    path: str | Path, set_name: str, name: str, exclude: dict[str, set[str]] | None = None
) -> str:
    """One published cell recomputed from a results dir: the comparison (``"opd − sft"``), ratio (``"P1"``,
    ``"τ(opd) / τ(sft)"``) or arm (``"opd"``: its τ) called ``name`` on ``set_name``, as the table prints it
    (without the prompts ``exclude`` names, for a sensitivity analysis)."""
    s = compare_study(path, exclude=exclude)["sets"][set_name]
    name = name.replace(" - ", " − ")
    for c in s["comparisons"]:
        if c["name"] == name:
            return comparison_cell(c)
    for r in s["ratios"]:
        if r["name"] == name or (name == "P1" and r["endpoint"] == "primary"):
            return ratio_cell(r)
    a = s["arms"][name]
    return f"{a['tau']:.3f} {interval(a, '.3f')}"


def _primary_lines(result: dict[str, Any]) -> list[str]:
    p = result["study"]["primary"]
    if p is None:
        return ["No primary endpoint is declared in `study.json`: every comparison below is exploratory.", ""]
    found = result["sets"].get(p["set"], {})
    c = next((c for c in found.get("comparisons", []) if c["endpoint"] == "primary"), None)
    r = next((r for r in found.get("ratios", []) if r["endpoint"] == "primary"), None)
    head = f"**Primary endpoint** (declared in `study.json`): {p['arm']} − {p['baseline']} per prompt on {p['set']}"
    if c is None or "mean" not in c:
        return [f"{head}: not measured (no paired {p['arm']} and {p['baseline']} drafts on {p['set']}).", ""]
    sl = c["seed_level"]
    over_seeds = (
        f"over seeds {sl['mean']:+.3f} {interval(sl, '+.3f')}, {in_words(sl)}"
        if np.isfinite(sl["lo"]) and np.isfinite(sl["hi"])
        else "one seed, so no interval over seeds"
    )
    return [
        f"{head}, seeds averaged within each prompt, prompts resampled: **{comparison_cell(c)}** "
        f"({_grid_size(c['prompts'], c['seed_ids'])}), {in_words(c)}; {over_seeds}."
        + (f" P1 = τ({p['arm']}) / τ({p['baseline']}) = {ratio_cell(r)}, {in_words(r, 1.0)}." if r else ""),
        "Every other comparison is exploratory.",
        "",
    ]


LEGEND = (
    "95% intervals. *Prompts clustered*: percentile bootstrap over prompts, each with its mean over seeds. *Over "
    "seeds*: t-interval over the per-seed means (sees training noise that moves a whole seed; needs 2+ seeds). "
    "*Naive*: every prompt-seed pair as an independent prompt (too narrow; for reference only). Differences are "
    "paired per prompt and seed (a branch point against every seed); τ is the mean over seeds of pooled τ."
)


def _set_table(name: str, s: dict[str, Any]) -> list[str]:
    lines = [
        f"## {name} (K = {s['k']}, max_new_tokens = {s['max_new_tokens']})",
        "",
        "| arm | prompts × seeds | τ per seed | τ [95% CI, prompts clustered] | τ over seeds [95% t-CI] | "
        "train FLOPs |",
        "|---|---|---|---|---|---|",
    ]
    for arm, a in s["arms"].items():
        over = "-" if a["seed_ids"] == [None] else interval(a["seed_level"], ".3f")
        per_seed = ", ".join(
            f"{'' if i is None else f's{i} '}{t:.3f}" for i, t in zip(a["seed_ids"], a["per_seed"])
        )
        lines.append(
            f"| {arm} | {_grid_size(a['prompts'], a['seed_ids'])} | {per_seed} | {a['tau']:.3f} "
            f"{interval(a, '.3f')} | {over} | {_flops(a['flops'])} |"
        )
    lines += [
        "",
        "| comparison | endpoint | prompts × seeds | Δτ per prompt [95% CI, prompts clustered] | in words | "
        "per-seed means | over seeds [95% t-CI] | in words | naive [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in s["comparisons"]:
        end = "**primary**" if c["endpoint"] == "primary" else "exploratory"
        if "mean" not in c:
            lines.append(f"| {c['name']} | {end} | - | - (no seed of one side has the other) | | | | | |")
            continue
        sl, unpaired = c["seed_level"], f" (unpaired seeds: {c['unpaired']})" if c["unpaired"] else ""
        lines.append(
            f"| {c['name']} | {end} | {_grid_size(c['prompts'], c['seed_ids'])}{unpaired} | {comparison_cell(c)} | "
            f"{in_words(c)} | {', '.join(f'{m:+.3f}' for m in sl['per_seed'])} | {interval(sl, '+.3f')} | "
            f"{in_words(sl)} | {interval(c['naive'], '+.3f')} |"
        )
    lines += [
        "",
        "| ratio | endpoint | prompts | τ ratio [95% CI, prompts clustered] | in words |",
        "|---|---|---|---|---|",
    ]
    for r in s["ratios"]:
        end, p1 = ("**primary**", "P1 = ") if r["endpoint"] == "primary" else ("exploratory", "")
        lines.append(f"| {p1}{r['name']} | {end} | {r['prompts']} | {ratio_cell(r)} | {in_words(r, 1.0)} |")
    return [*lines, ""]


SET_TITLES = {"mtbench": "MT-Bench"}
SUMMARY_BEGIN = "<!-- compare summary: {name} (generated: python -m draft_opd_ray.compare results/{name}) -->"
SUMMARY_END = "<!-- end of compare summary -->"


def _set_title(name: str) -> str:
    return SET_TITLES.get(name, name)


def _over_seeds(sl: dict[str, Any], fmt: str) -> str:
    return (
        f"{interval(sl, fmt)}, {in_words(sl)}"
        if np.isfinite(sl["lo"]) and np.isfinite(sl["hi"])
        else "one seed"
    )


def render_summary(result: dict[str, Any]) -> str:
    """Every set side by side in two tables, the form `docs/results.md` quotes: each arm's τ (per seed, the mean
    over seeds with its prompt-clustered CI, training FLOPs), then each comparison's per-prompt Δτ with its
    prompt-clustered CI and seed-level t-interval, each read in words. Between markers, so a document can hold
    the block verbatim (`--into`) and a test can check it is the files' numbers."""
    sets = result["sets"]
    names = list(sets)
    arms: list[str] = list(dict.fromkeys(a for s in sets.values() for a in s["arms"]))
    head = " | ".join(f"{_set_title(n)} τ per seed | {_set_title(n)} τ [95% CI]" for n in names)
    lines = [
        SUMMARY_BEGIN.format(name=result["study"]["name"]),
        "",
        f"| arm | train FLOPs | {head} |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for arm in arms:
        cells = []
        for n in names:
            a = sets[n]["arms"].get(arm)
            if a is None:
                cells += ["-", "-"]
                continue
            seeds = ", ".join(
                f"{'' if i is None else f's{i} '}{t:.3f}" for i, t in zip(a["seed_ids"], a["per_seed"])
            )
            cells += [seeds, f"{a['tau']:.3f} {interval(a, '.3f')}"]
        flops = _flops([f for s in sets.values() for f in s["arms"].get(arm, {}).get("flops", [])])
        lines.append(f"| {arm} | {flops} | {' | '.join(cells)} |")
    head = " | ".join(
        f"{_set_title(n)}: prompts × seeds | {_set_title(n)}: Δτ per prompt [95% CI, prompts clustered] | "
        f"{_set_title(n)}: over seeds [95% t-CI]"
        for n in names
    )
    lines += ["", f"| comparison | {head} |", "|---|" + "---|---|---|" * len(names)]
    order = list(dict.fromkeys(c["name"] for s in sets.values() for c in s["comparisons"]))
    for name in order:
        cells, primary = [], ""
        for n in names:
            c = next((c for c in sets[n]["comparisons"] if c["name"] == name), None)
            if c is None or "mean" not in c:
                cells += ["-", "-", "-"]
                continue
            primary = primary or (f" (**primary**, {_set_title(n)})" if c["endpoint"] == "primary" else "")
            cells += [
                f"{c['prompts']} × {len(c['seed_ids'])}",
                f"{comparison_cell(c)}, {in_words(c)}",
                _over_seeds(c["seed_level"], "+.3f"),
            ]
        lines.append(f"| {name}{primary} | {' | '.join(cells)} |")
    return "\n".join([*lines, "", SUMMARY_END]) + "\n"


def write_summary_into(doc: str | Path, result: dict[str, Any]) -> None:
    """Replace the study's summary block in ``doc`` (between its markers) with the recomputed one."""
    path = Path(doc)
    text = path.read_text()
    begin = SUMMARY_BEGIN.format(name=result["study"]["name"])
    start, end = text.find(begin), text.find(SUMMARY_END, text.find(begin))
    if start < 0 or end < 0:
        raise DataError(f"{path}: no block from {begin!r} to {SUMMARY_END!r} to write the summary into")
    write_text_atomic(path, text[:start] + render_summary(result) + text[end + len(SUMMARY_END) + 1 :])


def render_study(result: dict[str, Any]) -> str:
    st = result["study"]
    lines = [f"# {st['name']}: {st['question']}", ""]
    for name, keys in result.get("excluded", {}).items():
        lines += [f"**Sensitivity analysis: {name} without prompts {', '.join(keys)}** (`--exclude`).", ""]
    lines += [*_primary_lines(result), LEGEND, ""]
    if st["notes"]:
        lines += [st["notes"], ""]
    for name, s in result["sets"].items():
        lines += _set_table(name, s)
    if not result["sets"]:
        lines.append("No results yet (no `<set>/<label>.json` file).")
    else:
        lines += ["## Summary (every set side by side)", "", render_summary(result)]
    return "\n".join(lines).rstrip("\n") + "\n"


def run_study(
    path: str | Path,
    *,
    out: str | Path | None = None,
    baseline: str | None = None,
    dataset: str | None = None,
    exclude: dict[str, set[str]] | None = None,
) -> dict[str, Any]:
    """Recompute a results dir's tables: print them and write `compare.{md,json}` to ``out`` (default: the dir;
    with ``exclude``, a sensitivity analysis, only to an ``out`` given, never over the dir's own tables)."""
    result = compare_study(path, baseline=baseline, dataset=dataset, exclude=exclude)
    table = render_study(result)
    if exclude and out is None:
        print(table, end="", flush=True)
        return result
    dest = Path(out) if out is not None else Path(path)
    dest.mkdir(parents=True, exist_ok=True)
    write_text_atomic(dest / "compare.md", table)
    write_text_atomic(dest / "compare.json", json.dumps(finite(result), indent=1, allow_nan=False) + "\n")
    print(table, end="", flush=True)
    return result
