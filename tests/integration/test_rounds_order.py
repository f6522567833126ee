"""A Draft-OPD step's batch does not depend on timing: `_Rounds.take(k)` returns the next k rounds in the order
they were handed out, whichever rollout worker finishes first, and a checkpoint's drain neither merges nor
reorders them (a step after a drain is as large as one before it)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.ray


def _feed_order(takes: list[list[list[Any]]]) -> list[list[int]]:
    """The first prompt of every round, per take."""
    return [[r[0] for r in got] for got in takes]


def test_a_step_takes_the_next_k_rounds_in_feed_order() -> None:
    import ray

    from draft_opd_ray.loop.opd import _Rounds

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Worker:
            """Echoes its prompts after ``delay`` s: worker 0 is slow, so worker 1's rounds finish first."""

            def __init__(self, delay: float):
                self.delay = delay

            def generate(self, prompts: list[list[int]], sampling: Any) -> list[int]:
                time.sleep(self.delay)
                return [p[0] for p in prompts]

        workers = [Worker.remote(0.3), Worker.remote(0.0)]  # type: ignore[attr-defined]
        prompts = [[i] for i in range(80)]
        for k in (1, 2, 3):
            rounds = _Rounds(workers, prompts, per_round=2, sampling=None)
            takes = [rounds.take(k) for _ in range(3)]
            rounds.drain()  # a checkpoint: every round in flight is kept for the next takes
            rounds.refill()
            takes += [rounds.take(k) for _ in range(3)]
            rounds.drain()
            starts = _feed_order(takes)
            assert all(len(t) == k for t in starts), (k, starts)  # the same batch before and after the drain
            flat = [s for t in starts for s in t]
            assert flat == list(range(0, 2 * 6 * k, 2)), (k, starts)  # every round once, in feed order
    finally:
        ray.shutdown()
