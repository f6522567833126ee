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
