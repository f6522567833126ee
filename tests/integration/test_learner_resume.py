"""Resuming the learner as on GPU: 2 learner ranks (Ray actors, one DeepSpeed data-parallel group over gloo), ZeRO-1
and ZeRO-2 in bfloat16 (the GPU configs `conf/cluster/*.yaml` use). A run checkpoints after two steps through the
driver's own path (`loop.opd.save_checkpoint`: rank 0's draft, every rank's optimizer state in
training_state.pt), a new group starts from that draft and loads the states through `checkpoint.load_state`
(weights_only: nothing unpickled), and its next steps log the same losses as the run left alone.

Tolerance: exact (==). The resumed ranks hold the same bf16 weights, the same fp32 master partitions and AdamW
moments (ZeRO restores them from the state, not re-widened from bf16) and the same lr schedule position, and run the
same ops in the same order on the same CPU; any difference would be a piece of state the resume lost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, LossConfig, OptimConfig
from tests.helpers import anchor_subsets

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed]

BEFORE, AFTER = 2, 2  # steps before the checkpoint, steps compared after it


def _group(draft: Path, target: Path, zero_stage: int) -> Any:
    from draft_opd_ray.loop.actors import LearnerGroup, start_learner_ranks
    from draft_opd_ray.opd.learner import LearnerRun

    run = LearnerRun(str(draft), str(target), total_steps=2 * (BEFORE + AFTER), num_threads=1)
    configs = (
        DraftConfig(kind="eagle3"),
        LossConfig(estimator="full"),
        # the resumed ranks must continue the schedule, not restart it
        OptimConfig(lr=1e-2, betas=[0.9, 0.95], weight_decay=0.01, warmup_ratio=0.25, schedule="cosine"),
        LearnerConfig(zero_stage=zero_stage, dtype="bfloat16", backend="gloo"),
    )
    ranks = start_learner_ranks(2, lambda r: {"num_cpus": 0.1}, run, configs)
    return LearnerGroup(ranks)


def _losses(group: Any, teacher: list, n: int) -> list[float]:
    return [group.step(teacher, mini_batches=2)["loss"] for _ in range(n)]


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_resume_continues_the_uninterrupted_run(
    ray_local: None, replay_case: Any, tmp_path: Path, zero_stage: int
) -> None:
    import ray

    from draft_opd_ray.checkpoint import load_state
    from draft_opd_ray.loop.opd import save_checkpoint

    c = replay_case
    teacher = c.replay("eagle3", c.eagle3).score(anchor_subsets(c.item))
    run = _group(c.eagle3, c.target, zero_stage)
    _losses(run, teacher, BEFORE)
    ckpt = save_checkpoint(tmp_path, BEFORE, run)
    left_alone = _losses(run, teacher, AFTER)
    for r in run.ranks:
        ray.kill(r)

    saved = load_state(ckpt / "training_state.pt")  # weights_only: raises on any pickled object
    assert len(saved["ranks"]) == 2 and all(s["version"] == BEFORE for s in saved["ranks"])
    resumed = _group(ckpt / "draft", c.target, zero_stage)
    resumed.load_optimizer_states(saved["ranks"])
    again = _losses(resumed, teacher, AFTER)
    assert again == left_alone, (again, left_alone)
    assert ray.get(resumed.rank0.world_size.remote()) == 2
