"""What the replay ships to the learner and how the driver hands it on: the features in the target's precision
(bfloat16 where teacher.dtype is bfloat16, half float32's bytes), the summaries the driver reads instead of the
items (sizes, agreement, bytes) and the step's hand-off, where the loop gives the learner ranks references and
summaries, never the teacher items. Ray is not started: the driver's plumbing is run with stand-ins for the
actor handles (`_one_step` only calls `.remote` on them), the replay actor itself runs in-process."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.config.schema import AnchorConfig, Config
from draft_opd_ray.loop.actors import LearnerGroup, Scored
from draft_opd_ray.opd.learner import split_by_anchors, split_mini_batches
from draft_opd_ray.wire import TeacherItem, TeacherSummary, learner_cost, payload_bytes
from tests.helpers import replay_actor, synth


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_features_ship_in_the_targets_precision(replay_case: Any, dtype: str) -> None:
    """Before: features were cast to float32 whatever the target's dtype (twice the bytes in bfloat16)."""
    c = replay_case
    replay = replay_actor(c.target, [0, 1, 2], None, c.num_speculative_tokens, dtype=dtype)
    (t,) = replay.score([c.item])
    assert t.features.dtype == getattr(torch, dtype)
    assert t.features.shape[0] == len(c.item.input_ids)
    # the teacher's log-probs stay float32: computed in float32 from the logits, the small top-k payload
    for x in (t.teacher_logprobs, t.teacher_topk_logprobs):
        assert x is None or x.dtype == torch.float32
    (f,) = replay_actor(
        c.target, [0, 1, 2], None, c.num_speculative_tokens, dtype=dtype, teacher=False
    ).score([c.item])
    assert f.features.dtype == getattr(torch, dtype)


def test_score_split_returns_summaries_then_the_items(replay_case: Any) -> None:
    c = replay_case
    replay = replay_actor(c.target, [0, 1, 2], None, c.num_speculative_tokens)
    out = replay.score_split([c.item, c.item])
    summaries, items = out[0], out[1:]
    assert len(items) == 2 and all(isinstance(t, TeacherItem) for t in items)
    t = items[0]
    assert summaries[0] == TeacherSummary.of(t)
    s = summaries[0]
    assert s.anchors == len(c.item.anchor_pos)
    assert s.learner_cost == learner_cost(t) and s.scored_tokens == t.scored_tokens()
    assert s.payload_bytes == payload_bytes(t) > 0 and s.target_ran
    assert s.agree == sum(int(a) == int(b) for a, b in zip(t.accepted, t.replay_accepted))


def _item(n_anchors: int, length: int) -> TeacherItem:
    K = 4
    return TeacherItem(
        torch.arange(length),
        torch.zeros(length, 6, dtype=torch.bfloat16),
        torch.arange(n_anchors),
        torch.zeros(n_anchors, K, dtype=torch.long),
        torch.full((n_anchors,), K),
        torch.ones(n_anchors, dtype=torch.long),
        torch.ones(n_anchors, dtype=torch.long),
        None,
        0,
        torch.zeros(n_anchors, K, 2, dtype=torch.long),
        torch.zeros(n_anchors, K, 2),
    )


def test_learner_shards_from_summaries_equal_the_shards_from_the_items() -> None:
    """The driver splits the references by the summaries exactly as it splits the items themselves."""
    rng = random.Random(0)
    batch = [_item(rng.randint(1, 6), rng.randint(8, 40)) for _ in range(11)]
    refs = [f"ref{i}" for i in range(len(batch))]  # stand-ins for ObjectRefs: only their order matters
    scored = Scored(refs, [TeacherSummary.of(t) for t in batch])
    for ranks in (1, 2, 3):
        group = LearnerGroup([object()] * ranks)
        for mb in (1, 3, 32):
            by_items = group.shards(batch, mb)
            by_refs = group.shards(scored, mb)
            index = {id(t): f"ref{i}" for i, t in enumerate(batch)}
            assert [[[index[id(t)] for t in g] for g in r] for r in by_items] == by_refs
    for parts in (1, 2, 5, 20):
        groups = split_mini_batches(batch, parts)
        idx = split_by_anchors([len(t.anchor_pos) for t in batch], parts)
        assert [[id(t) for t in g] for g in groups] == [[id(batch[i]) for i in g] for g in idx]


class _Remote:
    """An actor method handle: ``.remote(*args)`` calls ``fn`` (a stand-in for a Ray actor's method)."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn


def test_the_loop_hands_the_learner_references_and_summaries_not_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`_one_step` scores with `ReplayGroup.score_refs` and passes its `Scored` on to the learner ranks, and
    takes its metrics from the summaries (before: `score` fetched every TeacherItem to the driver, which then
    put them again for the learner ranks)."""
    import draft_opd_ray.loop.opd as loop
    from draft_opd_ray.metrics import MetricsLogger

    monkeypatch.setattr(loop, "wait_for", lambda ref, what, timeout=None: ref)  # stand-ins return values
    records = [synth(random.Random(i), num_speculative_tokens=4, steps=6) for i in range(3)]
    for r in records:
        r.policy_version = [0] * r.num_steps
    item = _item(3, 20)
    handed: list[Any] = []

    class Replay:
        last_shares = [3]
        restarts = 0

        def score(self, items: Any) -> Any:
            raise AssertionError("the loop fetched the teacher items to the driver")

        def score_refs(self, items: Any) -> Scored:
            return Scored([f"ref{i}" for i in range(len(items))], [TeacherSummary.of(item)] * len(items))

    class Learner:
        rank0 = type("Rank0", (), {"rollout_state": _Remote(lambda: {"w": torch.zeros(1)})})()

        def step(self, batch: Any, mini_batches: int, epochs: int = 1) -> dict[str, float]:
            handed.append(batch)
            return {"loss": 1.0, "updates": 1.0, "flops_draft_step": 0.0}

    class Rounds:
        restarts = 0

        def take(self, k: int) -> list[Any]:
            return [records]

    class Sync:
        def publish(self, version: int, weights: Any) -> None:
            pass

    actors = type("A", (), {"replay": Replay(), "learner": Learner(), "workers": [None], "world_size": 1})()
    cfg = Config(anchor=AnchorConfig(policy="all"))
    metrics = MetricsLogger(tmp_path, wandb_mode="disabled")
    monkeypatch.setattr(loop, "target_forward_flops", lambda info, b, n: float(n))  # FLOPs = scored tokens
    state = loop._LoopState(version=0)
    flops = {"flops_draft": 0.0, "flops_target": 0.0, "flops_rollout": 0.0}
    monkeypatch.setattr(loop, "rollout_target_flops", lambda info, r, k: 0.0)
    row = loop._one_step(cfg, actors, Rounds(), Sync(), state, 0, None, flops, tmp_path, metrics)  # type: ignore[arg-type]
    assert row is not None
    (batch,) = handed
    assert isinstance(batch, Scored)
    assert not any(isinstance(x, (TeacherItem, torch.Tensor)) for x in batch.refs)
    n = len(batch.refs)
    s = TeacherSummary.of(item)
    assert row["replay_accept_agree"] == pytest.approx(s.agree / s.anchors)
    assert row["replay_payload_mb"] == pytest.approx(round(n * s.payload_bytes / 2**20, 3))
    assert flops["flops_target"] == pytest.approx(n * s.scored_tokens)


def test_replay_ships_the_drafts_own_top_m_with_the_teachers_log_probs_there(replay_case: Any) -> None:
    """`loss.draft_topm`: the replay holds the draft and ships, per block position, the draft's own top-m ids
    (what the student's head ranks highest there) and the teacher's exact log-probs at them (the full payload's
    values at those ids), beside the teacher's top-k; the learner hands both to the `topk` estimator."""
    from draft_opd_ray.drafts.registry import draft_kind

    c = replay_case
    m = 5
    kw: dict[str, Any] = dict(draft_dir=str(c.eagle3))
    (t,) = c.replay("eagle3", c.eagle3, payload="topk", topk=4, draft_topm=m, **kw).score([c.item])
    (full,) = c.replay("eagle3", c.eagle3, payload="full").score([c.item])
    assert t.draft_topm_ids is not None and t.teacher_logprobs_at_draft is not None
    N, K = t.drafted.shape
    assert t.draft_topm_ids.shape == (N, K, m) == t.teacher_logprobs_at_draft.shape
    student = draft_kind("eagle3").student(str(c.eagle3), str(c.target))
    with torch.no_grad():
        own = (student.block_hidden(t) @ student.lm_head.T).topk(m, dim=-1).indices
    valid = torch.arange(K)[None] < t.valid_len[:, None]
    assert torch.equal(t.draft_topm_ids[valid], own[valid])
    assert full.teacher_logprobs is not None
    at = full.teacher_logprobs.gather(-1, t.draft_topm_ids)
    torch.testing.assert_close(t.teacher_logprobs_at_draft[valid], at[valid])
    assert t.teacher_logprobs is None and t.replay_draft_flops > 0
    # the replay's draft pass is a forward (`test_flops.py` counts it): for EAGLE-3 more than a third of forward +
    # backward, since the frozen head's and fc's backward cost what their forward does
    assert t.replay_draft_flops == pytest.approx(student.flops(t, backward=False))
    assert t.replay_draft_flops > student.flops(t) / 3
    assert TeacherSummary.of(t).draft_flops == t.replay_draft_flops
    # the teacher's mass outside the support (its top-k and the draft's top-m), in float64 from the full payload
    assert t.teacher_log_tail is not None and t.teacher_log_tail.shape == (N, K)
    assert t.teacher_topk_ids is not None
    p64 = full.teacher_logprobs.double().exp()
    in_s = torch.zeros_like(p64, dtype=torch.bool)
    in_s.scatter_(-1, t.teacher_topk_ids, True).scatter_(-1, t.draft_topm_ids, True)
    want = p64.masked_fill(in_s, 0).sum(-1).log()
    torch.testing.assert_close(t.teacher_log_tail[valid].double(), want[valid], rtol=1e-5, atol=1e-5)
    # without it (and for the controls, which train on committed tokens) nothing more ships and no draft is held
    plain = c.replay("eagle3", c.eagle3, payload="topk", topk=4)
    (p,) = plain.score([c.item])
    assert p.draft_topm_ids is None and plain.student is None
    assert payload_bytes(t) > payload_bytes(p)
