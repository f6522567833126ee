"""Anchor policies against brute force on synthetic records."""

from __future__ import annotations

import random

import pytest

from draft_opd_ray.algo.anchors import select_anchors
from tests.helpers import synth


@pytest.fixture
def records():
    rng = random.Random(0)
    return [synth(rng, num_speculative_tokens=4, steps=8) for _ in range(6)]


def test_all_and_error(records) -> None:
    big = 10**6
    every = select_anchors(records, policy="all", max_per_sequence=big, max_per_step=big)
    errors = select_anchors(records, policy="error", max_per_sequence=big, max_per_step=big)
    assert len(every) == sum(r.num_steps for r in records)
    brute = [
        (q, r.anchor_pos[i]) for q, r in enumerate(records) for i in range(r.num_steps) if r.accepted[i] < 4
    ]
    assert [(a.request, a.pos) for a in errors] == brute
    for a in errors:
        rec = records[a.request]
        assert rec.drafted[a.step] == list(a.drafted) and a.accepted == rec.accepted[a.step] < 4


def test_random_is_budget_matched(records) -> None:
    big = 10**6
    errors = select_anchors(records, policy="error", max_per_sequence=big, max_per_step=big)
    rand = select_anchors(records, policy="random", max_per_sequence=big, max_per_step=big, seed=3)
    for q, rec in enumerate(records):
        mine = [a for a in rand if a.request == q]
        assert len(mine) == sum(1 for a in errors if a.request == q)
        lo, hi = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.response_ids) - 2
        assert all(lo <= a.pos <= hi and a.drafted == () and a.step == -1 for a in mine)
        assert len({a.pos for a in mine}) == len(mine)
    assert rand == select_anchors(records, policy="random", max_per_sequence=big, max_per_step=big, seed=3)


def test_budgets(records) -> None:
    per_seq = select_anchors(records, policy="all", max_per_sequence=3, max_per_step=10**6)
    assert all(sum(1 for a in per_seq if a.request == q) == 3 for q in range(len(records)))
    capped = select_anchors(records, policy="all", max_per_sequence=3, max_per_step=7)
    # the step cap keeps whole sequences (2 of 3 anchors each fit in 7), never part of one
    assert len(capped) == 6 and set(capped) <= set(per_seq)
    assert all(sum(1 for a in capped if a.request == q) in (0, 3) for q in range(len(records)))
    assert capped == sorted(capped, key=lambda a: (a.request, a.pos))


def test_defaults_drop_no_anchor() -> None:
    """The configured defaults keep every error anchor of a step of long rollouts (32 requests x 256 tokens, K
    = 4, tau ~ 1.8: ~150 error anchors each), so no replay forward is paid for anchors that are then dropped."""
    from draft_opd_ray.config.schema import AnchorConfig

    rng = random.Random(1)
    recs = [synth(rng, num_speculative_tokens=4, steps=150) for _ in range(32)]
    a = AnchorConfig()
    got = select_anchors(
        recs, policy="error", max_per_sequence=a.max_per_sequence, max_per_step=a.max_per_step
    )
    want = sum(1 for r in recs for acc, d in zip(r.accepted, r.drafted) if acc < len(d))
    assert len(got) == want > 32 * 64
