"""Standalone draft LM (vLLM method ``draft_model``): a small causal LM with the target's tokenizer, by default a
slice of the target's layers; conditions on no target features. `model.py` (building, loading, saving the HF
folder), `student.py` (Draft-OPD), `recipe.py` (SFT: distillation), `drafter.py` (reference engine)."""

from __future__ import annotations

from typing import Any

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.kind import DraftKind, PathLike, Pieces
from draft_opd_ray.drafts.standalone import layout
from draft_opd_ray.errors import ConfigError, ModelError


def pieces() -> Pieces:
    from draft_opd_ray.drafts.standalone import drafter, model, recipe, student

    return Pieces.of(model, student, recipe, drafter)


def check_fits(d: DraftConfig, num_layers: int, vocab_size: int) -> None:
    if d.path is None and not 1 <= d.num_layers < num_layers:
        raise ConfigError(
            f"draft.num_layers: a standalone draft made of target layers needs 1..{num_layers - 1} layers "
            f"(the target has {num_layers}), got {d.num_layers}"
        )


def check_folder(_: PathLike, d: dict[str, Any], t: dict[str, Any], key: str) -> None:
    tv, dv = t.get("vocab_size"), d.get("vocab_size")
    if tv != dv:
        raise ModelError(
            f"{key}: draft vocabulary {dv} differs from the target's {tv}; a standalone draft "
            "must use the target's tokenizer"
        )


KIND = DraftKind(
    name="standalone",
    vllm_method="draft_model",
    architecture="",
    feature_conditioned=False,
    starts_fresh=False,
    pieces=pieces,
    fits_check=check_fits,
    folder_check=check_folder,
    weights_layout=layout.layout,
)
