"""EAGLE-3 head (vLLM method ``eagle3``): conditions on the inputs of 3 target layers, has its own draft
vocabulary and LM head, and can start fresh. `model.py` (model, vLLM checkpoint), `student.py` (Draft-OPD),
`recipe.py` (SFT: training-time test), `drafter.py` (reference engine)."""

from __future__ import annotations

from typing import Any

from draft_opd_ray.config.schema import DEFAULT_DRAFT_VOCAB, LARGE_VOCAB, DraftConfig
from draft_opd_ray.drafts.eagle3 import layout
from draft_opd_ray.drafts.kind import DraftKind, PathLike, Pieces
from draft_opd_ray.errors import ConfigError, ModelError
from draft_opd_ray.sizing import Derived


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


def check_folder(_: PathLike, d: dict[str, Any], t: dict[str, Any], key: str) -> None:
    """Its own vocabulary maps into the target's (d2t): it may be smaller, never larger."""
    tv: Any = t.get("vocab_size")
    vd: Any = d.get("draft_vocab_size", d.get("vocab_size"))
    if vd > tv:
        raise ModelError(f"{key}: draft_vocab_size {d.get('draft_vocab_size')} exceeds the target's {tv}")


def vocabulary(d: DraftConfig, target_vocab: int) -> int:
    """`draft.draft_vocab_size`; by default the most frequent 32,000 tokens of a 100k+ vocabulary, else 8,192 (or
    the whole vocabulary when smaller)."""
    return int(d.vocab_for(target_vocab))


def sizing(d: DraftConfig, target: Any) -> list[Derived]:
    """The draft vocabulary and the auxiliary layers, from the target's vocabulary and depth."""
    from draft_opd_ray.drafts.eagle3.model import default_aux_layer_ids

    v, n = target.vocab_size, target.num_layers
    rule = (
        "32,000 for a vocabulary of 100k or more, as EAGLE-3's released heads"
        if v >= LARGE_VOCAB
        else ("8,192 below a 100k vocabulary" if v > DEFAULT_DRAFT_VOCAB else "the whole vocabulary")
    )
    return [
        Derived(
            "draft.draft_vocab_size",
            vocabulary(d, v),
            f"the most frequent response tokens of the target's {v}: {rule}",
            derived=d.draft_vocab_size is None,
        ),
        Derived(
            "draft.aux_layer_ids",
            list(d.aux_layer_ids) if d.aux_layer_ids is not None else list(default_aux_layer_ids(n)),
            f"(2, L/2, L-1) of the target's L = {n} layers",
            derived=d.aux_layer_ids is None,
        ),
    ]


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
    weights_layout=layout.layout,
    foreign_layout=layout.foreign,
    draft_vocabulary=vocabulary,
    sizing=sizing,
)
