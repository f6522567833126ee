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
  and reloads in place. One serialisation in all, none per worker. Files are slots that are overwritten in
  place (`write_safetensors`, plain `pwrite`s: no new tmpfs pages, no page faults) once every receiver has
  applied the version they held; a new slot is made only while all others are still being read.
- `ObjectStoreWeightSync` (multi-node): the state dict goes into Ray's object store once (shared memory on a
  node) and every receiver reads the same object, then writes its own file for its engine.
On GPU clusters an NCCL broadcast transport plugs in here.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write `tensors` (CPU) as a safetensors file at `path`, overwriting an existing file's pages in place.

    Same bytes as `safetensors.torch.save_file` reads back, but written with `pwrite` straight from each tensor's
    memory: no intermediate serialised copy, and on tmpfs an existing file of the same size needs no new pages
    (a third of `save_file`'s time into a new file, docs/LOG.md). Returns the file size. Not atomic: callers
    overwrite only files nobody is reading.
    """
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.device.type != "cpu" or t.dtype not in _DTYPES:
            raise ValueError(f"write_safetensors: {name} is {t.dtype} on {t.device}; need a CPU tensor")
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        pos = os.pwrite(fd, struct.pack("<Q", len(head)) + head, 0)
        for t in tensors.values():
            if t.numel():
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                view = memoryview(raw)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
                while view:  # pwrite may write less than asked
                    done = os.pwrite(fd, view, pos)
                    pos += done
                    view = view[done:]
        os.ftruncate(fd, pos)
    finally:
        os.close(fd)
    return pos


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
        import tempfile

        base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.dir = tempfile.mkdtemp(prefix="draft_opd_ray_sync_", dir=base)
        self.receivers = list(receivers)
        self.version = 0
        self._pending: list[tuple[str, list[Any]]] = []  # (slot file, its loads)
        self._free: list[str] = []  # slot files no receiver is reading
        self._slots = 0

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        self._reap(block=False)
        if self._free:
            path = self._free.pop()
        else:
            path = os.path.join(self.dir, f"slot{self._slots}.safetensors")
            self._slots += 1
        write_safetensors(path, weights)
        self._pending.append(
            (path, [r.load_draft_weights_file.remote(path, version) for r in self.receivers])
        )
        self.version = version

    @property
    def slots(self) -> int:
        """Slot files made so far (2 when receivers keep up: one being read, one being written)."""
        return self._slots

    def _reap(self, block: bool) -> list[int]:
        import ray

        done: list[int] = []
        keep = []
        for path, refs in self._pending:
            if block or all(_done(r) for r in refs):
                done += ray.get(refs)
                self._free.append(path)
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
