"""The two training arms are equal in what they train, in precision and in schedule (draft_opd_ray/optim.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_opd_ray.config.schema import Config, DraftConfig
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.optim import LR_FLOOR, deepspeed_config, lr_factor, trainable_parameters, update_lr_factor


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("train_lm_head", [False, True])
def test_sft_and_opd_train_the_same_eagle3_weights(
    tiny_target: Path, tmp_path: Path, train_lm_head: bool
) -> None:
    """The SFT recipe's head and the Draft-OPD student loaded from its export train the same weights."""
    from draft_opd_ray.drafts.recipe import RecipeInputs

    draft = DraftConfig(draft_vocab_size=64, ttt_steps=2, train_lm_head=train_lm_head)
    seqs, plens = [list(range(3, 40))], [8]
    recipe = draft_kind(draft.kind).recipe(tiny_target, draft, RecipeInputs(seqs, plens))
    sft = _names(recipe.model, trainable_parameters(recipe.model, "eagle3", draft.train_lm_head))
    recipe.save(recipe.model, tmp_path / "d", tiny_target)
    student = draft_kind("eagle3").student(str(tmp_path / "d"), str(tiny_target))
    opd = _names(student.model, trainable_parameters(student.model, "eagle3", draft.train_lm_head))
    assert sft == opd
    assert ("lm_head.weight" in sft) == train_lm_head
    assert "embed_tokens.weight" not in sft  # the target's embedding stays frozen in both


def test_train_lm_head_only_where_a_kind_has_one() -> None:
    with pytest.raises(ConfigError, match="draft.train_lm_head"):
        draft_kind("standalone").check_config(DraftConfig(kind="standalone", train_lm_head=True))


def test_opd_schedule_does_not_jump_above_where_sft_ended() -> None:
    """With the defaults, every Draft-OPD update's lr is at most the SFT schedule's last lr, and it starts low
    (fresh AdamW moments) instead of at a peak 3x above it."""
    cfg = Config()
    sft_last = cfg.sft.lr * lr_factor(1.0, cfg.optim.warmup_ratio, cfg.optim.schedule)
    assert sft_last == pytest.approx(cfg.sft.lr * LR_FLOOR)
    total = cfg.opd.steps * cfg.learner.mini_batches
    o = cfg.optim
    lrs = [
        o.lr * update_lr_factor(s, total, o.warmup_ratio, o.schedule) for s in range(total)
    ]  # the learner's
    assert max(lrs) <= sft_last * (1 + 1e-9)
    assert 0 < lrs[0] < 0.2 * sft_last
    assert all(b >= a for a, b in zip(lrs, lrs[1 : max(1, int(total * cfg.optim.warmup_ratio))]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_deepspeed_precision_follows_learner_dtype(dtype: str) -> None:
    c = deepspeed_config(zero_stage=1, dtype=dtype, grad_clip=1.0)
    assert c["bf16"]["enabled"] == (dtype == "bfloat16") and c["fp16"]["enabled"] == (dtype == "float16")
    assert c["zero_optimization"]["stage"] == 1 and c["gradient_clipping"] == 1.0
