"""How a step's sequences are shared between replay actors and learner ranks, against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from draft_opd_ray.distributed import balanced_shards
from draft_opd_ray.loop.actors import merge_rank_rows
from draft_opd_ray.wire import ReplayItem, replay_cost


@pytest.mark.parametrize("seed", range(20))
def test_balanced_shards_partition_in_order_and_near_the_best_split(seed: int) -> None:
    rng = random.Random(seed)
    w = [rng.randint(1, 100) for _ in range(rng.randint(0, 8))]
    parts = rng.randint(1, 3)
    shards = balanced_shards(w, parts)
    assert len(shards) == parts
    assert sorted(i for s in shards for i in s) == list(range(len(w)))
    assert all(s == sorted(s) for s in shards)
    worst = max((sum(w[i] for i in s) for s in shards), default=0)
    best = min(  # every assignment of items to parts
        (
            max(sum(x for x, p in zip(w, a) if p == q) for q in range(parts))
            for a in itertools.product(range(parts), repeat=len(w))
        ),
        default=0,
    )
    assert worst <= 4 / 3 * best + 1e-9  # longest-first greedy's bound


def test_fewer_items_than_parts_leaves_shards_empty() -> None:
    assert balanced_shards([5], 3) == [[0], [], []]
    with pytest.raises(ValueError):
        balanced_shards([1], 0)


def test_replay_cost_counts_sequence_and_branches() -> None:
    it = ReplayItem(list(range(20)), [3, 8], [[1, 2, 3, 4], [5, 6]], [1, 2], 0)
    assert replay_cost(it) == 20 + (4 - 1 - 1) + 0


def test_rank_rows_add_up_and_share_the_denominator() -> None:
    rows = [
        {"loss": 0.5, "denominator": 10.0, "lr": 1e-4, "updates": 2.0, "anchors": 3.0, "n_rev": 4.0},
        {"loss": 0.25, "denominator": 10.0, "lr": 1e-4, "updates": 2.0, "anchors": 5.0, "n_rev": 1.0},
    ]
    assert merge_rank_rows(rows) == {
        "denominator": 10.0,
        "lr": 1e-4,
        "updates": 2.0,
        "loss": 0.75,
        "anchors": 8.0,
        "n_rev": 5.0,
    }
    assert merge_rank_rows([{"skipped": 1.0}, {"skipped": 1.0}]) == {"skipped": 1.0}
    nan = {"skipped": 1.0, "nonfinite_updates": 2.0}  # every rank skipped the same two updates
    assert merge_rank_rows([nan, nan]) == nan
