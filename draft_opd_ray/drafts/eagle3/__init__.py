"""EAGLE-3 head (vLLM method ``eagle3``): conditions on the inputs of 3 target layers, has its own draft
vocabulary and LM head, and can start fresh. `model.py` (model, vLLM checkpoint), `student.py` (Draft-OPD),
`recipe.py` (SFT: training-time test), `drafter.py` (reference engine)."""

from __future__ import annotations

from typing import Any

from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.drafts.kind import DraftKind, PathLike, Pieces
from draft_opd_ray.errors import ConfigError, ModelError


def pieces() -> Pieces:
    from draft_opd_ray.drafts.eagle3 import drafter, model, recipe, student

    return Pieces.of(model, student, recipe, drafter)


def check_fits(d: DraftConfig, num_layers: int, vocab_size: int) -> None:
    if d.aux_layer_ids is not None:
        bad = [i for i in d.aux_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(
                f"draft.aux_layer_ids: {bad} out of range for a target with {num_layers} layers"
            )
    if d.draft_vocab_size is not None and d.draft_vocab_size > vocab_size:
        raise ConfigError(
            f"draft.draft_vocab_size: {d.draft_vocab_size} exceeds the target vocabulary {vocab_size}"
        )


def check_folder(_: PathLike, d: dict[str, Any], t: dict[str, Any]) -> None:
    """Its own vocabulary maps into the target's (d2t): it may be smaller, never larger."""
    tv: Any = t.get("vocab_size")
    vd: Any = d.get("draft_vocab_size", d.get("vocab_size"))
    if vd > tv:
        raise ModelError(
            f"draft.path: draft_vocab_size {d.get('draft_vocab_size')} exceeds the target's {tv}"
        )


def vocabulary(d: DraftConfig, target_vocab: int) -> int:
    """`draft.draft_vocab_size`; by default the most frequent 8,192 tokens, or the whole vocabulary when smaller."""
    return int(d.vocab_for(target_vocab))


KIND = DraftKind(
    name="eagle3",
    vllm_method="eagle3",
    architecture="LlamaForCausalLMEagle3",
    feature_conditioned=True,
    features_from_drafter=True,
    starts_fresh=True,
    pieces=pieces,
    lm_head_option=True,
    vllm_aliases={"midlayer.": "layers.0."},
    fits_check=check_fits,
    folder_check=check_folder,
    draft_vocabulary=vocabulary,
)
