"""`eval/regime.py` against a brute-force count over the position sets of `algo/loss.py`."""

from __future__ import annotations

import random

import pytest
import torch

from draft_opd_ray.algo.anchors import select_anchors
from draft_opd_ray.algo.loss import position_sets
from draft_opd_ray.eval.regime import regime
from tests.helpers import synth


def test_regime_counts_match_the_losss_position_sets_and_the_anchor_policies() -> None:
    rng = random.Random(3)
    records = [synth(rng, num_speculative_tokens=4, steps=rng.randint(1, 9)) for _ in range(12)]
    out = regime(records)
    acc = torch.tensor([a for r in records for a in r.accepted])
    valid = torch.tensor([len(d) for r in records for d in r.drafted])
    sets = position_sets(acc, valid, 4, "all")
    n = len(acc)
    assert out["blocks"] == n and out["k"] == 4
    assert out["mean_forward_positions"] == pytest.approx(float(sets.forward_set.sum()) / n)
    assert out["mean_rejected_positions"] == pytest.approx(float(sets.rejected.sum()) / n)
    assert out["mean_accepted"] == pytest.approx(float(acc.double().mean()))
    assert out["share_with_rejection"] == pytest.approx(float((acc < valid).double().mean()))
    assert out["share_accepting_none"] == pytest.approx(float((acc == 0).double().mean()))
    assert sum(out["accepted_histogram"]) == n
    error = select_anchors(records, policy="error")
    every = select_anchors(records, policy="all")
    assert out["error_anchors_per_block_start"] == pytest.approx(len(error) / len(every))
