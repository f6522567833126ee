"""Draft weight publication from the learner to the rollout workers (and replay's draft copy).

Interface: `publish(version, weights)` on the learner side; `load_draft_weights(weights, version)` on each
receiver (a Ray actor method). Invariants:
- the learner is the only sender; versions it publishes strictly increase;
- a receiver applies a version whole, between two generation rounds (Ray serialises an actor's calls),
  never in the middle of a round, and tags every later record with it;
- publication does not wait for receivers: rollouts keep generating; `wait()` is for shutdown and tests.
Transports:
- `SharedFileWeightSync` (single node, the default there): the publisher writes the state dict ONCE per version
  to a safetensors file in shared memory and sends every receiver its path; each vLLM engine memory-maps it
  and reloads in place. One serialisation in all, none per worker; a version's file is removed once every
  receiver has applied it.
- `ObjectStoreWeightSync` (multi-node): the state dict goes into Ray's object store once (shared memory on a
  node) and every receiver reads the same object, then writes its own file for its engine.
On GPU clusters an NCCL broadcast transport plugs in here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Protocol


class WeightSync(Protocol):
    version: int  # the last published version (set it when resuming)

    def publish(self, version: int, weights: dict[str, Any]) -> None: ...

    def wait(self) -> list[int]: ...

    def close(self) -> None: ...


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

    def close(self) -> None:
        self.wait()


class SharedFileWeightSync:
    """All receivers on the publisher's node (module docstring). Receivers need `load_draft_weights_file`."""

    def __init__(self, receivers: Sequence[Any], directory: str | None = None) -> None:
        import os
        import tempfile

        base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.dir = tempfile.mkdtemp(prefix="draft_opd_ray_sync_", dir=base)
        self.receivers = list(receivers)
        self.version = 0
        self._pending: list[tuple[str, list[Any]]] = []  # (file, its loads)

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        import os

        from safetensors.torch import save_file

        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        path = os.path.join(self.dir, f"v{version}.safetensors")
        save_file({k: v.contiguous() for k, v in weights.items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._reap(block=False)
        self._pending.append(
            (path, [r.load_draft_weights_file.remote(path, version) for r in self.receivers])
        )
        self.version = version

    def _reap(self, block: bool) -> list[int]:
        import os

        import ray

        done: list[int] = []
        keep = []
        for path, refs in self._pending:
            if block or all(_done(r) for r in refs):
                done += ray.get(refs)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            else:
                keep.append((path, refs))
        self._pending = keep
        return done

    def wait(self) -> list[int]:
        return self._reap(block=True)

    def close(self) -> None:
        import shutil

        self.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _done(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
