"""Scale-out changes nothing but the speed: one Draft-OPD step with 2 replay actors and 2 learner ranks (one
DeepSpeed data-parallel group over gloo, in Ray actors) gives the same teacher items and the same updated weights
as 1 x 1 on the same records (float32). The system-level twin of the loss's batch-split invariance test
(tests/unit/test_loss.py).

Tolerance: teacher items equal to 1e-6 (the same forward on another actor); loss rel 1e-5; updated weights within
1e-6 + 1e-3 x lr of each other (the ranks' gradients are summed in another order than one rank's, and AdamW's
first update is about lr x sign(g), so only a near-zero gradient component could move by more than float
rounding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import anchor_subsets, learner_configs, replay_configs

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed]

LR = 1e-3


def _groups(case: Any, replays: int, ranks: int) -> tuple[Any, Any]:
    import ray

    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.loop.actors import LearnerGroup, ReplayGroup, start_learner_ranks
    from draft_opd_ray.opd.learner import LearnerRun
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    feats, ids = draft_kind("eagle3").replay_needs(str(case.eagle3), str(case.target))
    actors = [
        ray.remote(ReplayActor)
        .options(num_cpus=0.1)
        .remote(
            ReplayRun(str(case.target), feats, ids, num_threads=1),
            *replay_configs("eagle3", case.num_speculative_tokens),
        )
        for _ in range(replays)
    ]
    run = LearnerRun(str(case.eagle3), str(case.target), total_steps=10, num_threads=1)
    configs = learner_configs("eagle3", "full", lr=LR, backend="gloo")
    learners = start_learner_ranks(ranks, lambda r: {"num_cpus": 0.1}, run, configs)
    return ReplayGroup(actors), LearnerGroup(learners)


def test_two_by_two_equals_one_by_one(ray_local: None, replay_case: Any) -> None:
    import ray

    items = anchor_subsets(replay_case.item)
    one_replay, one_learner = _groups(replay_case, 1, 1)
    two_replay, two_learner = _groups(replay_case, 2, 2)

    t1, t2 = one_replay.score(items), two_replay.score(items)
    assert two_replay.last_shares == [2, 2] or sorted(two_replay.last_shares) == [1, 3]
    assert all(n > 0 for n in two_replay.scored_sequences())
    for a, b in zip(t1, t2):
        assert torch.equal(a.anchor_pos, b.anchor_pos)
        assert torch.allclose(a.teacher_logprobs, b.teacher_logprobs, atol=1e-6)
        assert torch.allclose(a.features, b.features, atol=1e-6)

    before = ray.get(one_learner.rank0.rollout_state.remote())
    r1 = one_learner.step(t1, mini_batches=2)
    r2 = two_learner.step(t2, mini_batches=2)
    assert r1["updates"] == r2["updates"] == 2.0
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
    # float64 weights summed per rank, then across ranks in float64 (`algo.loss.denominator`, `all_reduce_sum`):
    # another order, so not exact, but far inside 1e-9 (float32 sums would need ~1e-6)
    assert r2["denominator"] == pytest.approx(r1["denominator"], rel=1e-9)
    assert r2["anchors"] == r1["anchors"] == sum(len(it.anchor_pos) for it in items)

    w1 = ray.get(one_learner.rank0.rollout_state.remote())
    ranks = [ray.get(r.rollout_state.remote()) for r in two_learner.ranks]
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1 if w1[k].is_floating_point())
    assert moved > 0.5 * LR  # the step did update the weights
    for k in w1:
        if not w1[k].is_floating_point():
            continue
        for w2 in ranks:  # both ranks hold the same weights, equal to one rank's
            diff = float((w1[k] - w2[k]).abs().max())
            assert diff <= 1e-6 + 1e-3 * LR, (k, diff)
