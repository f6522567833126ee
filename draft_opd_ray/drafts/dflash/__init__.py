"""DFlash block drafter (vLLM method ``dflash``): a few layers conditioned on target layer outputs, proposing
``block_size - 1`` tokens in one forward with the target's embedding and LM head. `model.py` (model, vLLM
checkpoint), `student.py` (Draft-OPD), `recipe.py` (SFT: random-anchor block loss), `drafter.py` (reference
engine)."""

from __future__ import annotations

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.dflash import layout
from draft_opd_ray.drafts.kind import DraftKind, Pieces
from draft_opd_ray.errors import ConfigError


def pieces() -> Pieces:
    from draft_opd_ray.drafts.dflash import drafter, model, recipe, student

    return Pieces.of(model, student, recipe, drafter)


def check_config(d: DraftConfig) -> None:
    if d.num_speculative_tokens != d.block_size - 1:
        raise ConfigError(
            f"draft.num_speculative_tokens: DFlash proposes block_size - 1 = {d.block_size - 1} tokens per step, "
            f"got {d.num_speculative_tokens} (set both, e.g. draft.block_size=8 draft.num_speculative_tokens=7)"
        )


def check_fits(d: DraftConfig, num_layers: int, vocab_size: int) -> None:
    if d.mask_token_id is not None and not 0 <= d.mask_token_id < vocab_size:
        raise ConfigError(
            f"draft.mask_token_id: {d.mask_token_id} is outside the target vocabulary [0, {vocab_size})"
        )


KIND = DraftKind(
    name="dflash",
    vllm_method="dflash",
    architecture="DFlashDraftModel",
    feature_conditioned=True,
    starts_fresh=False,
    pieces=pieces,
    config_check=check_config,
    fits_check=check_fits,
    weights_layout=layout.layout,
)
