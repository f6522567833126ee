"""The toy SFT recipe: a fresh toy draft distilled on the target's top-k (the standalone kind's loss)."""

from __future__ import annotations

import os

import torch

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.recipe import Recipe, RecipeInputs
from draft_opd_ray.drafts.standalone.recipe import standalone_kd_loss
from draft_opd_ray.models.target import read_target_info
from tests.kinds.toykind.model import fresh_toy, load_toy, save_toy


def toy_recipe(target: str | os.PathLike[str], draft: DraftConfig, src: RecipeInputs) -> Recipe:
    lm = (
        load_toy(src.start_from, target) if src.start_from is not None else fresh_toy(target, draft, src.seed)
    )
    lm.train()
    return Recipe(
        "toy",
        lm,
        (),
        torch.arange(read_target_info(target).vocab_size),
        lambda m, b, *, reduce=None: standalone_kd_loss(m, b, reduce=reduce),
        lambda b: 0.0,
        lambda m, out, t: save_toy(m, out, t),
    )


recipe = toy_recipe  # the kind's interface (`drafts/kind.py`, `Pieces.of`)
