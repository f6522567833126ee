"""A toy draft kind: one folder and one table line (`tests/unit/test_draft_kinds.py` adds `KIND` to the table).

A one-layer causal LM made of the target's first layer, its embedding, final norm and LM head, served as vLLM's
``draft_model``; it can start fresh (a slice needs no training), and its own check is that it has one layer.
Its pieces reuse the shared bases of `draft_opd_ray/drafts/` (`DraftStudent`, `Recipe`, the drafters).
"""

from __future__ import annotations

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.kind import DraftKind, Pieces
from draft_opd_ray.errors import ConfigError


def pieces() -> Pieces:
    from tests.kinds.toykind import drafter, model, recipe, student

    return Pieces.of(model, student, recipe, drafter)


def check_config(d: DraftConfig) -> None:
    if d.num_layers != 1:
        raise ConfigError(f"draft.num_layers: a toy draft has one layer, got {d.num_layers}")


KIND = DraftKind(
    name="toy",
    vllm_method="draft_model",
    architecture="",
    feature_conditioned=False,
    starts_fresh=True,
    pieces=pieces,
    config_check=check_config,
)
