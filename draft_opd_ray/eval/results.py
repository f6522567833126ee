"""Raw results of a study, kept in the repo: what each draft measured on each prompt set, prompt by prompt.

    results/<study>/study.json          the study: name, question, primary endpoint, baseline arm, notes
    results/<study>/<set>/<label>.json  one draft on one prompt set; <label> is <arm>_s<seed>, or branch

The format is described field by field in `results/README.md`; `load_study` reads and checks a study dir
(`python -m draft_opd_ray.compare results/<study>` recomputes every table from it; `bench/study.py export`
writes one). Bad input raises `DataError` with one line naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import DataError

STUDY = "study.json"
BRANCH = "branch"


@dataclass(frozen=True)
class Primary:
    """The one comparison declared before the runs: ``arm`` minus ``baseline``, per prompt, on ``set``."""

    set: str
    arm: str
    baseline: str


@dataclass(frozen=True)
class Study:
    name: str
    question: str
    primary: Primary | None
    baseline: str  # the arm every other arm is compared against
    notes: str  # optional in the file ("" when absent)


@dataclass(frozen=True)
class Prompt:
    key: str  # the prompt's index in the set's order, as a string
    steps: int  # verification steps
    accepted: int  # accepted drafted tokens


@dataclass(frozen=True)
class DraftResult:
    """One draft measured on one prompt set."""

    arm: str  # "opd", "sft", ..., or "branch" (the point the arms started from)
    seed: int | None  # None for the branch point
    set: str  # "validation", "mtbench", ...
    k: int  # drafted tokens per verification step
    max_new_tokens: int
    flops: float | None  # training FLOPs of the arm from its branch point
    tokens: int | None  # training tokens, likewise
    command: str  # the command that trained it
    eval_command: str
    commit: str  # short git hash
    draft: str  # a label, not a path
    prompts: tuple[Prompt, ...]

    @property
    def label(self) -> str:
        return BRANCH if self.seed is None else f"{self.arm}_s{self.seed}"

    def counts(self) -> list[dict[str, int]]:
        """Per-prompt counts in key order, as `draft_opd_ray.eval.stats` takes them."""
        return [{"steps": p.steps, "accepted": p.accepted} for p in self.prompts]


def _field(
    data: dict[str, Any], key: str, kinds: tuple[type, ...], where: str | Path, *, null: bool = False
) -> Any:
    """``data[key]`` if it is one of ``kinds`` (or None where ``null``); else one `DataError` line."""
    if key not in data:
        raise DataError(f"{where}: missing {key!r}")
    v = data[key]
    if (v is None and null) or (isinstance(v, kinds) and not isinstance(v, bool)):
        return v
    names = " or ".join(k.__name__ for k in kinds) + (" or null" if null else "")
    raise DataError(f"{where}: {key!r} must be {names}, got {v!r}")


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path}: does not parse ({(str(e).splitlines() or ['?'])[0]})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a JSON object")
    return data


def read_study(path: Path) -> Study:
    data = _read(path)
    primary = _field(data, "primary", (dict,), path, null=True)
    if primary is not None:
        primary = Primary(*(_field(primary, k, (str,), path) for k in ("set", "arm", "baseline")))
    return Study(
        name=_field(data, "name", (str,), path),
        question=_field(data, "question", (str,), path),
        primary=primary,
        baseline=_field(data, "baseline", (str,), path),
        notes=_field(data, "notes", (str,), path) if "notes" in data else "",
    )


def _prompts(data: dict[str, Any], path: Path) -> tuple[Prompt, ...]:
    rows = _field(data, "prompts", (list,), path)
    out = []
    for i, row in enumerate(rows):
        where = f"{path}: prompts[{i}]"
        if not isinstance(row, dict):
            raise DataError(f"{where}: not an object")
        p = Prompt(
            _field(row, "key", (str,), where),
            _field(row, "steps", (int,), where),
            _field(row, "accepted", (int,), where),
        )
        if p.steps < 0 or p.accepted < 0:
            raise DataError(f"{where}: negative counts (steps {p.steps}, accepted {p.accepted})")
        out.append(p)
    if not out:
        raise DataError(f"{path}: 'prompts' is empty")
    if len({p.key for p in out}) != len(out):
        raise DataError(f"{path}: prompt keys repeat")
    return tuple(sorted(out, key=lambda p: (0, int(p.key), "") if p.key.isdigit() else (1, 0, p.key)))


def read_result(path: Path) -> DraftResult:
    """One draft's file, checked: every field's type, its label against arm and seed, its set against its dir."""
    data = _read(path)
    s = {
        k: _field(data, k, (str,), path) for k in ("arm", "set", "command", "eval_command", "commit", "draft")
    }
    r = DraftResult(
        **s,
        seed=_field(data, "seed", (int,), path, null=True),
        k=_field(data, "k", (int,), path),
        max_new_tokens=_field(data, "max_new_tokens", (int,), path),
        flops=_field(data, "flops", (int, float), path, null=True),
        tokens=_field(data, "tokens", (int,), path, null=True),
        prompts=_prompts(data, path),
    )
    if (r.seed is None) != (r.arm == BRANCH) or path.stem != r.label:
        raise DataError(
            f"{path}: the file of arm {r.arm!r}, seed {r.seed} must be named {r.label}.json (seed null for the "
            f"arm {BRANCH!r} alone)"
        )
    if r.set != path.parent.name:
        raise DataError(f"{path}: 'set' is {r.set!r} but the file is in {path.parent.name}/")
    return r


def _check_set(results: list[DraftResult], where: Path) -> None:
    """The drafts of one set: the same prompts, K and output length (else their per-prompt pairs mean nothing)."""
    first = results[0]
    for r in results[1:]:
        if [p.key for p in r.prompts] != [p.key for p in first.prompts]:
            raise DataError(f"{where}: {r.label}.json and {first.label}.json hold different prompt keys")
        if (r.k, r.max_new_tokens) != (first.k, first.max_new_tokens):
            raise DataError(
                f"{where}: {r.label}.json has k={r.k}, max_new_tokens={r.max_new_tokens}; "
                f"{first.label}.json has k={first.k}, max_new_tokens={first.max_new_tokens}"
            )


def is_study_dir(path: Path) -> bool:
    return (path / STUDY).is_file()


def load_study(path: str | Path) -> tuple[Study, dict[str, list[DraftResult]]]:
    """The study and, per set (sorted by name), its drafts: the branch point first, then by arm and seed."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path}: does not exist" if not path.exists() else f"{path}: not a directory")
    if not is_study_dir(path):
        raise DataError(f"{path}: not a results dir (no {STUDY})")
    study = read_study(path / STUDY)
    sets: dict[str, list[DraftResult]] = {}
    for d in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        results = sorted(
            (read_result(f) for f in d.glob("*.json")),
            key=lambda r: (r.arm != BRANCH, r.arm, -1 if r.seed is None else r.seed),
        )
        if results:
            _check_set(results, d)
            sets[d.name] = results
    return study, sets
