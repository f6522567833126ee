"""The toy draft: the target's first layer as a causal LM folder (the standalone kind's format)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from draft_opd_ray.drafts.standalone.model import (
    build_standalone_from_target,
    load_standalone,
    save_standalone,
)

PathLike = str | os.PathLike[str]


def fresh_toy(target: PathLike, draft: Any, seed: int) -> nn.Module:
    """The first target layer with the target's embedding, final norm and LM head (``seed``: nothing random)."""
    with tempfile.TemporaryDirectory() as tmp:
        return load_toy(build_standalone_from_target(target, tmp, layer_ids=(0,)), target)


def load_toy(path: PathLike, target: PathLike) -> nn.Module:
    return load_standalone(path, target)


def save_toy(model: nn.Module, out: PathLike, target: PathLike) -> Path:
    return save_standalone(model, out, target)


# the kind's interface (`drafts/kind.py`, `Pieces.of`)
load, save, fresh = load_toy, save_toy, fresh_toy
