"""Draft weight publication from the learner to the rollout workers (and replay's draft copy).

Interface: `publish(version, weights)` on the learner side; `load_draft_weights(weights, version)` on each
receiver (a Ray actor method). Invariants:
- the learner is the only sender; versions it publishes strictly increase;
- a receiver applies a version whole, between two generation rounds (Ray serialises an actor's calls),
  never in the middle of a round, and tags every later record with it;
- publication does not wait for receivers: rollouts keep generating; `wait()` is for shutdown and tests.
Transports: `ObjectStoreWeightSync` puts the state dict into Ray's object store once (shared memory on a
node) and every receiver reads the same object. On GPU clusters an NCCL broadcast transport plugs in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class WeightSync(Protocol):
    def publish(self, version: int, weights: dict[str, Any]) -> None: ...

    def wait(self) -> list[int]: ...


class ObjectStoreWeightSync:
    def __init__(self, receivers: Sequence[Any]) -> None:
        self.receivers = list(receivers)
        self.version = 0
        self._pending: list[Any] = []

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        import ray

        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        ref = ray.put(weights)  # one copy; receivers on the node map the same shared memory
        self._pending = [r for r in self._pending if not _done(r)]
        self._pending += [rcv.load_draft_weights.remote(ref, version) for rcv in self.receivers]
        self.version = version

    def wait(self) -> list[int]:
        import ray

        done, self._pending = ray.get(self._pending), []
        return done


def _done(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
