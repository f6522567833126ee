"""The loop's replay -> learner path on real Ray and DeepSpeed: `ReplayGroup.score_refs` gives the driver object
references and summaries only, the learner ranks fetch the items themselves, and the step is the same as one on
the items fetched to the driver (`score` + `step`, the path the loop took before). float32, one replay actor and
one learner rank on each path, the same records."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from draft_opd_ray.wire import ReplayItem, TeacherSummary
from tests.helpers import learner_configs, replay_configs

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed]


def _groups(case: Any) -> tuple[Any, Any]:
    import ray

    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.loop.actors import LearnerGroup, ReplayGroup, start_learner_ranks
    from draft_opd_ray.opd.learner import LearnerRun
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    feats, ids = draft_kind("eagle3").replay_needs(str(case.eagle3), str(case.target))
    actor = (
        ray.remote(ReplayActor)
        .options(num_cpus=0.1)
        .remote(
            ReplayRun(str(case.target), feats, ids, num_threads=1),
            *replay_configs("eagle3", case.num_speculative_tokens),
        )
    )
    run = LearnerRun(str(case.eagle3), str(case.target), total_steps=10, num_threads=1)
    ranks = start_learner_ranks(
        1, lambda r: {"num_cpus": 0.1}, run, learner_configs("eagle3", "full", lr=1e-3, backend="gloo")
    )
    return ReplayGroup([actor]), LearnerGroup(ranks)


def test_learner_ranks_fetch_the_items_the_driver_holds_references(ray_local: None, replay_case: Any) -> None:
    import ray

    from draft_opd_ray.wire import TeacherItem

    it = replay_case.item
    items = [
        ReplayItem(it.input_ids, it.anchor_pos[:n], it.drafted[:n], it.accepted[:n], 0) for n in (2, 5, 3)
    ]
    replay_a, learner_a = _groups(replay_case)
    replay_b, learner_b = _groups(replay_case)

    scored = replay_a.score_refs(items)
    assert len(scored.refs) == len(items)
    assert all(isinstance(r, ray.ObjectRef) for r in scored.refs)
    fetched = replay_b.score(items)  # the old path: every item on the driver
    assert scored.summaries == [TeacherSummary.of(t) for t in fetched]

    r_refs = learner_a.step(scored, mini_batches=2)
    r_items = learner_b.step(fetched, mini_batches=2)
    assert r_refs["updates"] == r_items["updates"] == 2.0
    assert r_refs["loss"] == pytest.approx(r_items["loss"], rel=1e-6)
    w_refs = ray.get(learner_a.rank0.rollout_state.remote())
    w_items = ray.get(learner_b.rank0.rollout_state.remote())
    for k in w_refs:
        assert torch.equal(w_refs[k], w_items[k]), k
    # the references still resolve to the items (the learner's fetch did not consume them)
    assert isinstance(ray.get(scored.refs[0]), TeacherItem)
