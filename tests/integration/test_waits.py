"""No hangs: a wait on an actor that does not answer ends within its timeout with a `RunError` naming the actor
and what it was doing (`draft_opd_ray.waits`)."""

from __future__ import annotations

import time

import pytest

from draft_opd_ray.errors import RunError

pytestmark = pytest.mark.ray


def test_a_stuck_actor_is_named_within_the_timeout() -> None:
    import ray

    from draft_opd_ray.waits import wait_for

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Stuck:
            def nap(self, s: float) -> float:
                time.sleep(s)
                return s

        a = Stuck.remote()  # type: ignore[attr-defined]
        assert wait_for(a.nap.remote(0.0), "stuck actor: warm up", timeout=60) == 0.0
        t0 = time.monotonic()
        with pytest.raises(RunError, match=r"replay actor 0: score 4 sequences: no answer in 2 s"):
            wait_for(a.nap.remote(60.0), "replay actor 0: score 4 sequences", timeout=2)
        assert time.monotonic() - t0 < 10
    finally:
        ray.shutdown()
