"""Atomic checkpoints: `checkpoints/<stage>/step_<n>/` plus the `latest` pointer, for every stage.

A checkpoint folder is filled under a temporary name and renamed into place, then `latest` (a text file holding
`step_<n>`) is replaced by a rename too; a reader therefore sees either the previous complete checkpoint or the
new one, never a half-written folder. `marker` names the file whose presence makes a folder complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

LATEST = "latest"


def write_checkpoint(root: Path, name: str, fill: Callable[[Path], None]) -> Path:
    """``root/name`` written atomically: ``fill(tmp)`` writes the contents into a temporary folder, which is
    renamed to ``root/name`` (replacing an older one of that name); then ``root/latest`` names it."""
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, root / LATEST)
    return final


def latest_checkpoint(root: Path, marker: str) -> Path | None:
    """The folder ``root/latest`` names, if it holds ``marker``; None when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    folder = root / pointer.read_text().strip()
    return folder if (folder / marker).is_file() else None
