"""Every wait on an actor is bounded. `wait_for` is `ray.get` with a timeout (`cluster.actor_timeout_s`, set
once per run by `configure`); when it passes, a `RunError` names the actor and what it was doing, instead of
a run that hangs for ever on a stuck collective, a wedged engine or a lost node."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from draft_opd_ray.errors import RunError

DEFAULT_TIMEOUT_S = 1800.0  # a CPU learner step or rollout round takes minutes; half an hour is a hang
_timeout_s = DEFAULT_TIMEOUT_S


def configure(timeout_s: float) -> None:
    """The run's bound on any one wait (the driver sets it from `cluster.actor_timeout_s`)."""
    global _timeout_s
    _timeout_s = float(timeout_s)


def timeout_s() -> float:
    return _timeout_s


def wait_for(refs: Any, what: str, timeout: float | None = None) -> Any:
    """``ray.get(refs)`` within ``timeout`` seconds (default: the run's); ``what`` names the actor and the call
    ("learner ranks: step 12"), for the error."""
    import ray
    from ray.exceptions import GetTimeoutError

    limit = _timeout_s if timeout is None else timeout
    try:
        return ray.get(refs, timeout=limit)
    except GetTimeoutError:
        raise RunError(
            f"{what}: no answer in {limit:.0f} s (cluster.actor_timeout_s); the actor is stuck or its node is "
            "gone. The last complete checkpoint is kept: resume=<run dir> continues from it"
        ) from None


def when_back(call: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
    """``wait_for(call())`` on an actor Ray is restarting: while it reports itself unavailable (restarting), wait
    and call again, within the timeout."""
    from ray.exceptions import ActorUnavailableError

    limit = _timeout_s if timeout is None else timeout
    deadline = time.monotonic() + limit
    while True:
        try:
            return wait_for(call(), what, max(1.0, deadline - time.monotonic()))
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise RunError(
                    f"{what}: the actor did not come back in {limit:.0f} s (cluster.actor_timeout_s)"
                ) from None
            time.sleep(1.0)
