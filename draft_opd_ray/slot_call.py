"""Model work of the driver's stages, run where Ray accounts for it.

The SFT stage's answers (a vLLM engine over the target) and the eval stage's engines hold the target on a device.
Run in the driver process they would take a GPU of the driver's node that Ray does not know is in use, beside the
actors Ray gives that same GPU to. With a reservation they run instead as a Ray task in the first rollout
worker's bundle (its GPUs, its node), which no actor holds between the stages: the SFT answers come before the
learner ranks start, and the OPD actors are gone before eval. Without a reservation (a run with no Ray stage on a
machine without GPUs: `driver.ray_stages`) they run in this process.

    result = call_in_slot(reservation, "sft: target answers", generate_trajectories, target, prompts, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from draft_opd_ray.placement import ROLLOUT, Reservation

T = TypeVar("T")


def call_in_slot(
    reservation: Reservation | None, what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any
) -> T:
    """``fn(*args, **kwargs)`` in rollout slot 0's bundle of ``reservation`` (a Ray task with that bundle's CPUs
    and GPUs), or here when there is none. ``fn`` must be importable by name (a module-level function); what it
    writes must be on storage the driver reads too (`cluster.storage_dir` on several nodes).

    The wait is not bounded by `cluster.actor_timeout_s`: the work is a whole stage's (answers for thousands of
    prompts), its progress bar shows in the driver's log, and Ray raises here when the task fails or its node is
    lost; the task's own error (a ConfigError, a DataError) comes back as that error."""
    if reservation is None:
        return fn(*args, **kwargs)
    import ray

    print(f"[slot] {what}: in the rollout bundle 0 of the reservation", flush=True)
    task = ray.remote(fn).options(**reservation.options(ROLLOUT, 0), max_retries=0)
    return ray.get(task.remote(*args, **kwargs))  # type: ignore[no-any-return]
