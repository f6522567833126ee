"""Anchor-record math against brute force: tau, per-position acceptance, invariants, Parquet round trip."""

from __future__ import annotations

import random
from pathlib import Path

from draft_opd_ray.rollout.records import acceptance_per_position, read_parquet, tau, write_parquet
from draft_opd_ray.wire import RequestRecord, consistency_error
from tests.helpers import synth


def test_tau_matches_brute_force() -> None:
    rng = random.Random(0)
    recs = [synth(rng) for _ in range(20)]
    committed = sum(len(r.response_ids) - 1 for r in recs)  # prefill token belongs to no step
    steps = sum(len(r.accepted) for r in recs)
    assert abs(tau(recs) - committed / steps) < 1e-12
    for r in recs:
        assert consistency_error(r) is None
        assert r.committed_by_steps() == len(r.response_ids)


def test_acceptance_per_position_brute_force() -> None:
    rng = random.Random(1)
    recs = [synth(rng, num_speculative_tokens=5) for _ in range(10)]
    got = acceptance_per_position(recs, 5)
    for j in range(1, 6):
        hits = sum(1 for r in recs for a in r.accepted if a >= j)
        seen = sum(1 for r in recs for d in r.drafted if len(d) >= j)
        assert abs(got[j - 1] - hits / seen) < 1e-12
    # tau = 1 + sum over positions of P(accepted at j) when every step drafts K tokens
    assert abs(tau(recs) - (1 + sum(got))) < 1e-9


def test_consistency_errors_are_named() -> None:
    rec = synth(random.Random(2))
    bad = RequestRecord(**{**rec.__dict__, "accepted": [*rec.accepted[:-1], 9]})
    assert "outside [0, 4]" in (consistency_error(bad) or "")
    bad = RequestRecord(**{**rec.__dict__, "anchor_pos": [rec.anchor_pos[0] + 1, *rec.anchor_pos[1:]]})
    assert "anchor_pos" in (consistency_error(bad) or "")
    bad = RequestRecord(**{**rec.__dict__, "response_ids": [*rec.response_ids, 1]})
    assert "steps commit" in (consistency_error(bad) or "")
    bad = RequestRecord(**{**rec.__dict__, "drafted": [[7, 7, 7, 7]] + rec.drafted[1:]})
    if rec.accepted[0] > 0:
        assert "differ from the committed" in (consistency_error(bad) or "")


def test_parquet_round_trip_is_lossless(tmp_path: Path) -> None:
    rng = random.Random(3)
    recs = [synth(rng) for _ in range(7)]
    path = write_parquet(recs, tmp_path / "anchors" / "round_0.parquet")
    back = read_parquet(path)
    assert [r.__dict__ for r in back] == [
        {
            **r.__dict__,
            "teacher_logprob_drafted": [
                [float(__import__("numpy").float32(x)) for x in row] for row in r.teacher_logprob_drafted
            ],
        }
        for r in recs
    ]
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)
    assert {"prompt_ids", "response_ids", "anchor_pos", "drafted", "accepted", "policy_version"} <= names
    assert not list(tmp_path.glob("anchors/*.tmp"))


def test_parquet_keeps_the_captured_teacher_only_when_asked(tmp_path: Path) -> None:
    """The rounds a checkpoint holds in flight keep their verification-pass teacher (a resumed step trains on it
    as the uninterrupted one would); the per-step anchor files do not carry it."""
    import numpy as np
    import torch

    from draft_opd_ray.wire import CapturedSteps

    rng = random.Random(4)
    recs = [synth(rng) for _ in range(3)]
    g = np.random.default_rng(0)
    for r in recs[:2]:
        S, K = r.num_steps, max(len(d) for d in r.drafted)
        r.captured = CapturedSteps(
            list(r.anchor_pos),
            [list(d) for d in r.drafted],
            list(r.accepted),
            g.integers(0, 50, (S, K + 1, 4)).astype(np.int32),
            g.standard_normal((S, K + 1, 4)).astype(np.float32),
            g.standard_normal((S, K + 1)).astype(np.float32),
            grammar=bool(r is recs[1]),
        )
    first = recs[0].captured
    assert first is not None  # EAGLE-3 feature rows by position ride along
    first.features = torch.randn(9, 5).to(torch.bfloat16)  # the target's dtype, bfloat16 on a GPU
    first.feature_seen = np.arange(9) % 4 != 0
    back = read_parquet(write_parquet(recs, tmp_path / "rounds.parquet", captured=True))
    assert back[2].captured is None and back[1].captured is not None and back[1].captured.features is None
    got = back[0].captured
    assert got is not None and got.features is not None and got.feature_seen is not None
    assert got.features.dtype == torch.bfloat16 and torch.equal(got.features, first.features)
    assert np.array_equal(got.feature_seen, first.feature_seen)
    for r, b in zip(recs[:2], back[:2]):
        assert r.captured is not None and b.captured is not None
        assert (b.captured.anchor_pos, b.captured.drafted, b.captured.accepted, b.captured.grammar) == (
            r.captured.anchor_pos,
            r.captured.drafted,
            r.captured.accepted,
            r.captured.grammar,
        )
        for name in ("topk_ids", "topk_logprobs", "log_tail"):
            got, want = getattr(b.captured, name), getattr(r.captured, name)
            assert got.dtype == want.dtype and np.array_equal(got, want)
    plain = read_parquet(write_parquet(recs, tmp_path / "anchors.parquet"))
    assert all(r.captured is None for r in plain)
