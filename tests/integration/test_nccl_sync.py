"""The NCCL weight sync's bookkeeping (`sync/nccl.py`) with real Ray actors standing in for the learner's
rank 0 and the engines. No NCCL runs here (no GPU): the stand-ins record the group they were told to join and
answer the sync's calls, so these tests check what the sync asks for and when it raises, not the broadcast.

- a failed send raises at once with the sender's error, while the engines' loads would wait for ever;
- an engine restarted by Ray makes the next publication re-form the group (a new endpoint; the sender and every
  engine join it, the sender drops the old one);
- an engine that dies before receiving a broadcast still pending stops the run with one line, not a hang.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from draft_opd_ray.errors import RunError

pytestmark = pytest.mark.ray

WEIGHTS = {"layers.0.w": torch.ones(2, 2)}


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    from draft_opd_ray import waits

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    waits.configure(30)  # a hang shows as a RunError after 30 s, not the run's half hour
    try:
        yield
    finally:
        waits.configure(waits.DEFAULT_TIMEOUT_S)
        ray.shutdown()


def _actors(send: str, load_s: list[float]) -> tuple[Any, list[Any]]:
    import ray

    @ray.remote(num_cpus=0)
    class Sender:
        """The learner's rank 0: hands out endpoints, records the groups it opened and dropped; its send
        succeeds, fails like a broken NCCL call, or blocks like a broadcast waiting for a dead rank."""

        def __init__(self, mode: str) -> None:
            self.mode, self.opened, self.dropped, self.ports = mode, [], [], 0

        def nccl_endpoint(self) -> tuple[str, int]:
            self.ports += 1
            return "127.0.0.1", 20000 + self.ports

        def nccl_open(self, address: str, port: int, world_size: int) -> None:
            self.dropped += self.opened[-1:]
            self.opened.append((port, world_size))

        def nccl_send(self) -> None:
            if self.mode == "fail":
                raise RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)")
            if self.mode == "stuck":
                time.sleep(600)

        def groups(self) -> tuple[list[Any], list[Any]]:
            return self.opened, self.dropped

    @ray.remote(num_cpus=0, max_restarts=1)
    class Engine:
        """A rollout worker: joins the group it is told to; its load takes ``load_s`` (the receive)."""

        def __init__(self, load_s: float) -> None:
            self.load_s, self.group = load_s, None

        def nccl_init(self, address: str, port: int, rank_offset: int, world_size: int) -> None:
            self.group = (port, rank_offset, world_size)

        def load_draft_weights_nccl(self, plan: dict[str, list[Any]], version: int) -> int:
            time.sleep(self.load_s)
            return version

        def load_draft_weights(self, weights: dict[str, Any], version: int) -> int:
            return version

        def joined(self) -> Any:
            return self.group

        def pid(self) -> int:
            return os.getpid()

    return Sender.remote(send), [Engine.remote(s) for s in load_s]  # type: ignore[attr-defined]


def test_a_failed_send_raises_at_once_instead_of_waiting_on_the_loads(ray_local: None) -> None:
    from draft_opd_ray.sync.nccl import NcclWeightSync

    sender, engines = _actors("fail", [600.0, 600.0])  # the receives never finish without the send
    sync = NcclWeightSync(engines, sender, [1, 1], verify=False)
    sync.publish(1, WEIGHTS)
    t0 = time.monotonic()
    with pytest.raises(RunError, match=r"learner rank 0: NCCL send of weight version 1 failed: .*NCCL error"):
        sync.wait()
    assert time.monotonic() - t0 < 15
    with pytest.raises(RunError, match="NCCL send of weight version 1 failed"):
        sync.publish(2, WEIGHTS)  # the next publication sees it too, without blocking


def test_a_restarted_engine_re_forms_the_group_before_the_next_publication(ray_local: None) -> None:
    import ray
    from ray.exceptions import RayActorError

    from draft_opd_ray.sync.nccl import NcclWeightSync
    from draft_opd_ray.waits import wait_for

    sender, engines = _actors("ok", [0.0, 0.0])
    sync = NcclWeightSync(engines, sender, [1, 2], verify=False)
    first = wait_for(sender.groups.remote(), "sender")[0][0]
    assert first[1] == 4 and wait_for([e.joined.remote() for e in engines], "engines") == [
        (first[0], 1, 4),
        (first[0], 2, 4),
    ]
    sync.publish(1, WEIGHTS)
    assert sync.wait() == [1, 1]

    pid = wait_for(engines[1].pid.remote(), "engine 1")
    ray.kill(engines[1], no_restart=False)  # Ray restarts it: it has no group any more
    deadline = time.monotonic() + 60
    while True:  # until the restarted engine answers (a call that meets the kill fails)
        with contextlib.suppress(RayActorError):
            if wait_for(engines[1].pid.remote(), "restarted engine", timeout=60) != pid:
                break
        assert time.monotonic() < deadline, "engine 1 was not restarted"
        time.sleep(0.2)
    assert wait_for(engines[1].joined.remote(), "restarted engine") is None
    sync.restarted(engines[1])
    assert sync.groups == 1  # re-formed at the next publication, not before
    sync.publish(2, WEIGHTS)
    assert sync.groups == 2
    opened, dropped = wait_for(sender.groups.remote(), "sender")
    second = opened[-1]
    assert len(opened) == 2 and dropped == [first] and second[0] != first[0]
    assert wait_for([e.joined.remote() for e in engines], "engines") == [(second[0], 1, 4), (second[0], 2, 4)]
    assert sync.wait() == [2, 2]
    sync.publish(3, WEIGHTS)  # no restart since: the same group
    assert sync.groups == 2 and sync.wait() == [3, 3]
    sync.restarted(object())  # not one of its engines (the replay actor's copy): nothing to do
    assert not sync._regroup


def test_an_engine_dead_before_a_pending_broadcast_stops_the_run(ray_local: None) -> None:
    import ray

    from draft_opd_ray.sync.nccl import NcclWeightSync

    sender, engines = _actors("stuck", [0.0, 30.0])  # engine 1 is still in its receive when it is killed
    sync = NcclWeightSync(engines, sender, [1, 1], verify=False, grace_s=2.0)
    sync.publish(1, WEIGHTS)
    time.sleep(0.5)
    ray.kill(engines[1], no_restart=False)
    t0 = time.monotonic()
    with pytest.raises(
        RunError, match=r"rollout engine 1 did not receive weight version 1 .* cannot complete"
    ):
        sync.restarted(engines[1])
    assert time.monotonic() - t0 < 15
