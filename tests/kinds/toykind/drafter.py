"""The toy draft in the reference engine: a plain causal LM drafter."""

from __future__ import annotations

import os
from typing import Any

from draft_opd_ray.drafts.standalone.drafter import CausalLMDrafter
from tests.kinds.toykind.model import load_toy


def toy_drafter(target: Any, draft_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Any:
    return CausalLMDrafter(load_toy(draft_dir, target_dir).eval())


drafter = toy_drafter  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
