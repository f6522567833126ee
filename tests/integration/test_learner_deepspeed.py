"""The DeepSpeed learner stepping each draft kind's student on the acceptance-aware objective over replayed blocks
(full and top-k teacher payloads): the loss decreases, versions count steps, and the weights it publishes and
exports are the trained ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.config.schema import LossConfig
from draft_opd_ray.opd.loop import loss_spec

pytestmark = pytest.mark.deepspeed


def _learner(draft: Path, target: Path, kind: str = "eagle3", estimator: str = "full") -> Any:
    from draft_opd_ray.opd.learner import Learner

    return Learner(
        str(draft),
        str(target),
        kind=kind,
        spec=loss_spec(LossConfig(estimator=estimator)),
        lr=3e-3,
        betas=[0.9, 0.95],
        weight_decay=0.0,
        warmup_ratio=0.0,
        schedule="constant",
        total_steps=10,
        zero_stage=0,
        grad_clip=1.0,
    )


def _steps(learner: Any, batch: list, n: int = 4) -> list[float]:
    losses = [learner.step(batch)["loss"] for _ in range(n)]
    assert losses[-1] < losses[0], losses
    return losses


def test_learner_steps_and_loss_decreases(replay_case) -> None:
    c = replay_case
    batch = c.replay("eagle3", c.eagle3).score([c.item])
    learner = _learner(c.eagle3, c.target)
    before = learner.rollout_state()
    _steps(learner, batch)
    after = learner.rollout_state()
    assert set(before) == set(after) and "embed_tokens.weight" not in after
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert learner.version == 4


def test_learner_trains_on_the_topk_payload(replay_case) -> None:
    """loss.estimator=topk on the teacher's top 8 (the payload itself: tests/unit/test_replay.py)."""
    c = replay_case
    (top,) = c.replay("eagle3", c.eagle3, payload="topk", topk=8).score([c.item])
    assert top.teacher_logprobs is None
    _steps(_learner(c.eagle3, c.target, estimator="topk"), [top])


@pytest.mark.parametrize("kind", ["standalone", "dflash"])
def test_learner_trains_and_exports_other_kinds(replay_case, tmp_path: Path, kind: str) -> None:
    """The standalone and DFlash students step on the same replayed teacher and export a folder their loader reads
    back with the trained weights."""
    from draft_opd_ray.models.kinds import draft_kind

    c = replay_case
    draft = c.draft(kind, tmp_path / kind)
    (t,) = c.replay(kind, draft).score([c.item])
    learner = _learner(draft, c.target, kind)
    before = learner.rollout_state()
    _steps(learner, [t])
    if kind == "standalone":
        assert "lm_head.weight" not in before  # tied: written once, as save_pretrained does
    reloaded = draft_kind(kind).load(learner.save(str(tmp_path / "out")), c.target).state_dict()
    trained = learner.model.state_dict()
    after = learner.rollout_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(reloaded[k], trained[k]) for k in before)  # every published weight, as trained
