"""The raw file behind one line of docs/benchmarks.md: `results/bench/<id>.json` (format: results/README.md).

Each bench script prints its line and also calls `write_result` with the headline value(s), the target, whether
it was met and the raw measurements the headline is computed from; the file adds the command as typed, the
commit, the machine and the date, so a number in the docs can be traced to a run and re-made by its command.

    ap = argparse.ArgumentParser(...)
    add_result_args(ap)                       # --out (default results/bench/{id}.json), --notes
    args = ap.parse_args()
    ...
    write_result(args, "P5", value={"49152": 0.107}, target="<= 0.25", met=True, raw={...})
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DEFAULT = "results/bench/{id}.json"
REQUIRED = ("id", "value", "target", "met", "raw", "command", "commit", "machine", "date")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.rstrip()  # not strip(): `git status --porcelain` lines start with a space


# the code the bench runs is the code at its start: others may commit while a long bench runs
START_COMMIT = _git("rev-parse", "--short", "HEAD").strip()
START_STATUS = _git("status", "--porcelain", "--untracked-files=no", "--", "draft_opd_ray", "bench")


def add_result_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--out",
        default=OUT_DEFAULT,
        help="where the raw result file goes ({id} is replaced by the benchmark id; relative to the repo root)",
    )
    ap.add_argument(
        "--notes",
        default="",
        help="a note for the result file, e.g. what else ran on the machine (left out of its `command`)",
    )


def typed_command(argv: list[str] | None = None) -> str:
    """The command as typed, with the script's path relative to the repo root and without ``--notes``:
    `python bench/x.py --a 1`."""
    argv = list(sys.argv if argv is None else argv)
    for i in reversed(range(len(argv))):
        if argv[i] == "--notes":
            del argv[i : i + 2]
        elif argv[i].startswith("--notes="):
            del argv[i]
    script = Path(argv[0])
    if script.is_absolute() and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + shlex.join(argv)


def machine() -> dict[str, Any]:
    """The CPU model, its cores, what `auto` precision resolves to here, and the load when the result was
    written (a ratio measured beside other jobs is noisier: the file says so)."""
    from draft_opd_ray.device import resolve_dtype, usable_cores

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "auto_precision": resolve_dtype("auto"),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return info


def write_result(
    args: argparse.Namespace,
    bench_id: str,
    *,
    value: Any,
    target: str | None,
    met: bool | None,
    raw: dict[str, Any],
) -> Path:
    """Write ``args.out`` (``{id}`` replaced by ``bench_id``; relative paths from the repo root) with
    ``args.notes``, and return its path.

    ``value``: the headline number, or a dict of named numbers, rounded as the docs quote them; ``met`` is None
    only where there is no target (``target`` None)."""
    path = Path(args.out.replace("{id}", bench_id))
    if not path.is_absolute():
        path = ROOT / path
    record = {
        "id": bench_id,
        "value": value,
        "target": target,
        "met": met,
        "raw": raw,
        "command": typed_command(),
        "commit": START_COMMIT,
        "uncommitted": [ln[3:] for ln in START_STATUS.splitlines()],  # tracked files changed since `commit`
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "notes": args.notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    return path
