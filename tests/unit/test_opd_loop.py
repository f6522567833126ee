"""The pure pieces of the Draft-OPD loop: records -> replay items, the staleness filter over finished rounds, and the
learner's mini-batch split. Records are built by hand."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from draft_opd_ray.config.schema import AnchorConfig, Config, LossConfig, ReplayConfig
from draft_opd_ray.loop.opd import replay_items, take_rounds
from draft_opd_ray.opd.learner import split_mini_batches
from draft_opd_ray.wire import RequestRecord, consistency_error
from tests.helpers import synth

BIG = 10**6


def cfg(policy: str, mode: str = "recorded") -> Config:
    return dataclasses.replace(
        Config(),
        anchor=AnchorConfig(policy=policy, max_per_sequence=BIG, max_per_step=BIG),
        replay=ReplayConfig(mode=mode),
    )


def record(versions: list[int], error: str = "", steps: bool = True) -> RequestRecord:
    """A consistent record with one verification step per entry of ``versions`` (its policy versions)."""
    rec = synth(random.Random(len(versions)), num_speculative_tokens=3, steps=len(versions) if steps else 0)
    rec.policy_version = list(versions) if steps else []
    rec.error = error
    return rec


# --------------------------------------------------------------------------------------------------
# replay_items
# --------------------------------------------------------------------------------------------------


def test_replay_items_carry_every_recorded_block_per_request() -> None:
    rng = random.Random(0)
    records = [synth(rng, num_speculative_tokens=4, steps=5) for _ in range(4)]
    items = replay_items(records, cfg("all"), seed=0)
    assert len(items) == len(records)
    for it, r in zip(items, records):
        assert it.input_ids == r.prompt_ids + r.response_ids
        assert (it.anchor_pos, it.drafted, it.accepted) == (r.anchor_pos, r.drafted, r.accepted)
        assert it.policy_version == r.policy_version[0]


def test_replay_items_keep_error_anchors_and_leave_out_requests_without_any() -> None:
    rng = random.Random(1)
    records = [synth(rng, num_speculative_tokens=4, steps=6) for _ in range(5)]
    full = RequestRecord([1, 2], [3, 4, 5, 6, 7], [2], [[4, 5, 6]], [3], [0], [[-0.1] * 3])  # fully accepted
    assert consistency_error(full) is None
    records.insert(2, full)
    items = replay_items(records, cfg("error"), seed=0)
    want = [
        [(p, d, a) for p, d, a in zip(r.anchor_pos, r.drafted, r.accepted) if a < len(d)] for r in records
    ]
    assert want[2] == [] and all(w for i, w in enumerate(want) if i != 2)
    want = [w for w in want if w]
    assert len(items) == len(want) == len(records) - 1
    for it, w in zip(items, want):
        assert list(zip(it.anchor_pos, it.drafted, it.accepted)) == w


def test_random_anchors_need_redraft() -> None:
    """Random positions have no recorded block: recorded replay drops them (and so the whole request); redraft
    keeps them with unknown acceptance and version clamped to 0."""
    rng = random.Random(2)
    records = [synth(rng, num_speculative_tokens=4, steps=6) for _ in range(3)]
    assert replay_items(records, cfg("random"), seed=0) == []
    items = replay_items(records, cfg("random", "redraft"), seed=0)
    assert items and len(items) <= len(records)
    for it in items:
        assert it.anchor_pos and all(d == [] for d in it.drafted)
        assert all(a == 0 for a in it.accepted) and it.policy_version == 0
        assert it.anchor_pos == sorted(it.anchor_pos)


# --------------------------------------------------------------------------------------------------
# take_rounds: the staleness filter
# --------------------------------------------------------------------------------------------------


def test_take_rounds_drops_stale_rounds_and_leaves_out_failed_requests() -> None:
    fresh = [record([4, 4]), record([5])]  # lag 1
    stale = [record([2, 5]), record([5])]  # its oldest block is 3 versions behind
    mixed = [record([3]), record([], error="empty prompt", steps=False), record([], steps=False)]  # lag 2
    errored_only = [record([], error="exceeds max_model_len", steps=False)]
    old_error = [record([0], error="aborted"), record([5])]  # the failed request's version does not count
    got, dropped, lag = take_rounds(
        [fresh, stale, mixed, errored_only, old_error], version=5, max_staleness=2
    )
    assert got == [*fresh, mixed[0], old_error[1]]
    assert dropped == 1 and lag == 2


def test_take_rounds_keeps_everything_within_the_bound() -> None:
    rounds = [[record([0])], [record([1, 2])]]
    got, dropped, lag = take_rounds(rounds, version=3, max_staleness=3)
    assert got == [*rounds[0], *rounds[1]] and dropped == 0 and lag == 3
    got, dropped, lag = take_rounds(rounds, version=3, max_staleness=0)
    assert got == [] and dropped == 2 and lag == 0
    assert take_rounds([], version=7, max_staleness=0) == ([], 0, 0)


# --------------------------------------------------------------------------------------------------
# split_mini_batches
# --------------------------------------------------------------------------------------------------


def test_split_mini_batches_keeps_sequences_whole_and_balanced() -> None:
    sizes = [5, 1, 7, 3, 3, 9, 2, 2]
    batch = [SimpleNamespace(anchor_pos=list(range(n)), i=i) for i, n in enumerate(sizes)]
    for parts in (1, 2, 3, 4, 8, 20):
        groups = split_mini_batches(batch, parts)  # type: ignore[arg-type]
        assert [b.i for g in groups for b in g] == list(range(len(sizes)))  # every sequence once, in order
        assert all(groups) and len(groups) == min(parts, len(sizes))
        if parts > 1:
            loads = [sum(len(b.anchor_pos) for b in g) for g in groups]
            assert max(loads) <= sum(sizes) / len(groups) + max(sizes), loads
    with pytest.raises(ValueError, match="mini_batches"):
        split_mini_batches(batch, 0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# sft_on_rollouts: committed blocks, no drafted ones
# --------------------------------------------------------------------------------------------------


def test_sft_on_rollouts_items_are_the_committed_continuations() -> None:
    from draft_opd_ray.loop.opd import committed_items

    rec = synth(random.Random(3), num_speculative_tokens=4, steps=5)
    c = dataclasses.replace(Config(), loss=LossConfig(objective="sft_on_rollouts"))
    (it,) = replay_items([rec], c, seed=0)
    assert it == committed_items([rec], 4)[0]
    seq = rec.prompt_ids + rec.response_ids
    p = len(rec.prompt_ids)
    assert it.anchor_pos == list(range(p - 1, len(seq) - 1))  # every response token is a target
    for n, y, a in zip(it.anchor_pos, it.drafted, it.accepted):
        assert y == seq[n + 1 : n + 5] and a == len(y)  # the block is the committed stream, all "accepted"


def test_committed_blocks_by_brute_force() -> None:
    import torch

    from draft_opd_ray.opd.batch import committed_blocks
    from draft_opd_ray.wire import TeacherItem

    seq = list(range(100, 120))
    anchors, acc, valid = [3, 10, 17, 18], [0, 2, 4, 1], [4, 4, 2, 1]
    t = TeacherItem(
        torch.tensor(seq),
        torch.zeros(20, 0),
        torch.tensor(anchors),
        torch.zeros(4, 4, dtype=torch.long),
        torch.tensor(valid),
        torch.tensor(acc),
        torch.tensor(acc),
        None,
        0,
    )
    got = committed_blocks(t).tolist()
    for j, (n, a, v) in enumerate(zip(anchors, acc, valid)):
        for k in range(1, 5):  # block position k: committed x_{n+k} while its context is the committed stream
            want = seq[n + k] if k <= a + 1 and k <= v and n + k < len(seq) else -1
            assert got[j][k - 1] == want, (j, k)


def test_non_finite_steps_are_counted_and_too_many_in_a_row_stop_the_run(tmp_path) -> None:
    """`opd.max_nonfinite_steps` skipped steps in a row stop the run with a `RunError` naming the last good
    weights; a good step in between resets the run of them, not the total."""
    from draft_opd_ray.checkpoint import write_checkpoint
    from draft_opd_ray.config.schema import OPDConfig
    from draft_opd_ray.errors import RunError
    from draft_opd_ray.loop.opd import _count_nonfinite, _LoopState

    c = dataclasses.replace(Config(), opd=OPDConfig(max_nonfinite_steps=2))
    state = _LoopState(version=5)
    nan = {"skipped": 1.0, "nonfinite_updates": 8.0}
    _count_nonfinite(c, state, {"skipped": 1.0, "nonfinite_updates": 0.0}, 0, tmp_path)  # empty, not NaN
    assert (state.nonfinite_run, state.nonfinite_steps) == (0, 0)
    _count_nonfinite(c, state, nan, 1, tmp_path)
    state.nonfinite_run = 0  # what a good step does
    _count_nonfinite(c, state, nan, 3, tmp_path)
    assert (state.nonfinite_run, state.nonfinite_steps) == (1, 2)
    write_checkpoint(
        tmp_path / "checkpoints" / "opd", "step_3", lambda t: (t / "training_state.pt").write_text("")
    )
    with pytest.raises(
        RunError, match=r"2 steps in a row \(to step 5\) had a non-finite loss .*step_3/draft"
    ):
        _count_nonfinite(c, state, nan, 4, tmp_path)


def test_the_drafts_own_top_m_is_used_with_the_replays_teacher_only_and_makes_the_replay_a_weight_receiver() -> (
    None
):
    """The default teacher is the verification pass's (`teacher.source=verify`): it ranked no other ids, so the
    draft's own top-m is not used and the replay holds no draft. With the replay's teacher it is (Draft-OPD only)."""
    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.loop.actors import replay_holds_draft
    from draft_opd_ray.opd.replay import replay_draft_topm

    cfg = Config()
    assert cfg.loss.draft_topm == 16 and cfg.teacher.source == "verify"
    assert replay_draft_topm(cfg.loss, cfg.teacher, cfg.replay) == 0 and not replay_holds_draft(cfg)
    cfg.teacher.source = "replay"
    assert replay_draft_topm(cfg.loss, cfg.teacher, cfg.replay) == 16 and replay_holds_draft(cfg)
    for key, value in (("objective", "sft_on_rollouts_soft"), ("objective", "sft_on_rollouts")):
        other = Config()
        other.teacher.source = "replay"
        setattr(other.loss, key, value)
        assert replay_draft_topm(other.loss, other.teacher, other.replay) == 0 and not replay_holds_draft(
            other
        )
    off = Config()
    off.teacher.source = "replay"
    off.loss.draft_topm = 0
    assert not replay_holds_draft(off)
    off.replay.mode = "redraft"
    assert replay_holds_draft(off)
