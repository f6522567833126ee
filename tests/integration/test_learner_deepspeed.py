"""The DeepSpeed learner stepping each draft kind's student on the acceptance-aware objective over replayed blocks
(full and top-k teacher payloads): the loss decreases, versions count steps, and the weights it publishes and
exports are the trained ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import learner_configs

pytestmark = pytest.mark.deepspeed


def _learner(
    draft: Path,
    target: Path,
    kind: str = "eagle3",
    estimator: str = "full",
    cpu_share: tuple[int, int] | None = None,
    **kwargs: Any,
) -> Any:
    """A learner rank of one: ``kwargs`` are `learner_configs`'s (objective, lr, dtype)."""
    from draft_opd_ray.opd.learner import Learner, LearnerRun

    run = LearnerRun(str(draft), str(target), total_steps=10, cpu_share=cpu_share)
    return Learner(run, *learner_configs(kind, estimator, **kwargs))


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
    from draft_opd_ray.drafts.registry import draft_kind

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


def test_learner_trains_with_the_token_estimator(replay_case) -> None:
    """loss.estimator=token (single-token estimators on the committed and drafted ids) on the full payload."""
    c = replay_case
    batch = c.replay("eagle3", c.eagle3).score([c.item])
    _steps(_learner(c.eagle3, c.target, estimator="token"), batch)


def test_learner_honours_bfloat16(replay_case) -> None:
    """learner.dtype=bfloat16: the engine's module computes in bfloat16 and still learns."""
    c = replay_case
    batch = c.replay("eagle3", c.eagle3).score([c.item])
    learner = _learner(c.eagle3, c.target, dtype="bfloat16", lr=1e-2)
    assert {p.dtype for p in learner.engine.module.parameters()} == {torch.bfloat16}
    _steps(learner, batch)
    assert all(v.dtype == torch.bfloat16 for v in learner.rollout_state().values() if v.is_floating_point())


def test_sft_on_rollouts_is_cross_entropy_on_committed_tokens_without_teacher(replay_case) -> None:
    """loss.objective=sft_on_rollouts: the replay ships features only (no teacher distribution) and the learner's
    loss is the mean cross-entropy of the student's block positions against the committed tokens."""
    from draft_opd_ray.loop.opd import committed_items
    from draft_opd_ray.opd.batch import committed_blocks
    from draft_opd_ray.wire import RequestRecord

    c = replay_case
    prompt_len = 6
    rec = RequestRecord(c.item.input_ids[:prompt_len], c.item.input_ids[prompt_len:], policy_version=[0])
    items = committed_items([rec], c.num_speculative_tokens)
    (t,) = c.replay("eagle3", c.eagle3, teacher=False).score(items)
    assert t.teacher_logprobs is None and t.teacher_topk_ids is None and t.features.shape[1] > 0
    learner = _learner(c.eagle3, c.target, objective="sft_on_rollouts")
    with torch.no_grad():
        hidden = learner.student.block_hidden(t)
        labels = learner._student_ids(committed_blocks(t))
        keep = labels >= 0
        want = torch.nn.functional.cross_entropy(hidden[keep] @ learner.student.lm_head.T, labels[keep])
    out = learner.step([t])
    assert out["loss"] == pytest.approx(float(want), rel=1e-5)
    _steps(learner, [t])


def test_a_non_finite_update_applies_nothing_and_the_next_good_one_steps(replay_case) -> None:
    """A teacher with a NaN log-prob makes the loss NaN: the update is skipped (weights, optimizer moments, lr
    schedule and version untouched) and counted; the next finite batch steps as usual."""
    import dataclasses

    c = replay_case
    (good,) = c.replay("eagle3", c.eagle3).score([c.item])
    assert good.teacher_logprobs is not None
    poisoned = good.teacher_logprobs.clone()
    poisoned[0, 0, 0] = float("nan")
    bad = dataclasses.replace(good, teacher_logprobs=poisoned)
    learner = _learner(c.eagle3, c.target)
    before = {k: v.clone() for k, v in learner.rollout_state().items()}
    out = learner.step([bad])
    assert out == {"skipped": 1.0, "nonfinite_updates": 1.0}
    after = learner.rollout_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert learner.version == 0 and learner.engine.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in learner.engine.module.parameters())
    out = learner.step([good])
    assert "skipped" not in out and out["nonfinite_updates"] == 0.0 and learner.version == 1
    assert all(torch.isfinite(v).all() for v in learner.rollout_state().values())
    assert any(not torch.equal(before[k], v) for k, v in learner.rollout_state().items())


def test_replay_and_learner_take_their_cpu_share(replay_case) -> None:
    """`cpu_share` (reserved cores, sharers: `loop/actors.py: cpu_share`) sets the actor's torch threads."""
    from draft_opd_ray.device import node_threads

    c = replay_case
    cores = node_threads()
    try:
        c.replay("eagle3", c.eagle3, cpu_share=(cores, 1))
        assert torch.get_num_threads() == 1  # every core reserved for engines: one thread
        c.replay("eagle3", c.eagle3, cpu_share=(0, 1))
        assert torch.get_num_threads() == cores
        torch.set_num_threads(1)
        _learner(c.eagle3, c.target, cpu_share=(0, 2))
        assert torch.get_num_threads() == max(1, cores // 2)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_step_logs_the_gradient_norm_and_how_often_the_clip_fired(replay_case, dtype: str) -> None:
    """`grad_norm` (the mean over the step's updates of the norm before clipping) and `clipped_updates` (updates
    whose norm exceeded `optim.grad_clip`), in float32 (DeepSpeed keeps no norm there: the gradients' own) and
    bfloat16 (DeepSpeed's): the norm equals the parameters' gradient norm taken before the step."""
    import dataclasses

    from draft_opd_ray.opd.learner import Learner, LearnerRun

    c = replay_case
    batch = c.replay("eagle3", c.eagle3).score([c.item])
    draft, loss, optim, learner = learner_configs("eagle3", "full", dtype=dtype)
    run = LearnerRun(str(c.eagle3), str(c.target), total_steps=10)
    for clip, clipped in ((1e-6, 1.0), (1e9, 0.0)):
        lrn = Learner(run, draft, loss, dataclasses.replace(optim, grad_clip=clip), learner)
        seen: list[float] = []
        step = lrn.engine.step

        def spy(lrn: Any = lrn, seen: list[float] = seen, step: Any = step) -> None:
            grads = [p.grad.float() for p in lrn.engine.module.parameters() if p.grad is not None]
            seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
            step()

        lrn.engine.step = spy
        out = lrn.step(batch)
        assert out["updates"] == 1.0 and out["clipped_updates"] == clipped
        assert out["grad_norm"] > 0 and out["grad_norm"] == pytest.approx(seen[0], rel=1e-2)
