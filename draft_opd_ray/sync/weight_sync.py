"""Draft weight publication from the learner to the rollout workers (and replay's draft copy).

Interface: `publish(version, weights)` on the learner side; `load_draft_weights(weights, version)` on each
receiver (a Ray actor method). Invariants:
- the learner is the only sender; versions it publishes strictly increase;
- a receiver applies a version whole, between two generation rounds (Ray serialises an actor's calls),
  never in the middle of a round, and tags every later record with it;
- publication does not wait for receivers: rollouts keep generating; `wait()` is for shutdown and tests;
- every applied version is proven (`sync/refit.py`): after its load each receiver reads back what it serves and
  returns a `RefitAck` (`refit_ack()`), which the sync checks against the fingerprints of what it sent when it
  reaps the acks (the next `publish`, `wait`, `close`); a wrong version or different values raise `RefitError`
  naming the receiver. The receivers' serving dtypes are read once, from an ack taken at construction.
Transports:
- `SharedFileWeightSync` (single node, the default there): the publisher writes the state dict ONCE per version
  to a safetensors file in shared memory and sends every receiver its path; each vLLM engine memory-maps it
  and reloads in place. One serialisation in all, none per worker. Files are slots that are overwritten in
  place (`write_safetensors`, plain `pwrite`s: no new tmpfs pages, no page faults) once every receiver has
  applied the version they held; a new slot is made only while all others are still being read.
- `ObjectStoreWeightSync` (multi-node): the state dict goes into Ray's object store once (shared memory on a
  node) and every receiver reads the same object, then writes its own file for its engine.
- `NcclWeightSync` (`sync/nccl.py`, GPU clusters): the learner's rank 0 broadcasts to every engine rank
  through vLLM's weight-transfer API.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from draft_opd_ray.sync.refit import Fingerprint, check_ack, fingerprints
from draft_opd_ray.waits import wait_for

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
    (docs/benchmarks.md, P6). Returns the file size. Not atomic: callers
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

    def close(self, wait: bool = True) -> None:
        """Free the transport; ``wait`` first checks the refits still pending (False: after a failure)."""
        ...

    def restarted(self, receiver: Any) -> None:
        """Ray restarted ``receiver`` (the loop then gives it the current weights): a transport that keeps
        state in the receivers (NCCL's group) rebuilds it before the next publication; the file and object-store
        transports keep none."""
        ...


def _actor_died() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError)


class RefitChecks:
    """The refit proof's bookkeeping, shared by the transports: the receivers' serving dtypes, and per published
    version the fingerprints of what was sent and the receivers' pending loads and acks."""

    def __init__(self, receivers: Sequence[Any], verify: bool = True) -> None:
        self.verify = verify
        acks = []
        if verify and receivers:
            acks = wait_for([r.refit_ack.remote() for r in receivers], "weight receivers: serving dtype")
        self.dtypes = sorted({a.dtype for a in acks})
        self._pending: list[tuple[int, dict[str, dict[str, Fingerprint]], list[Any], list[Any]]] = []

    def sent(self, weights: dict[str, Any]) -> dict[str, dict[str, Fingerprint]]:
        """Fingerprints of ``weights`` in every dtype a receiver serves in (take them before sending)."""
        return {dt: fingerprints(weights.items(), getattr(torch, dt)) for dt in self.dtypes}

    def add(
        self,
        version: int,
        sent: dict[str, dict[str, Fingerprint]],
        loads: list[Any],
        receivers: Sequence[Any],
    ) -> None:
        """Loads just submitted; each receiver's ack is asked for right behind its load (actor calls run in
        order)."""
        acks = [r.refit_ack.remote() for r in receivers] if self.verify else []
        self._pending.append((version, sent, loads, acks))

    def reap(self, block: bool) -> tuple[list[int], int]:
        """Check the finished versions (all of them with ``block``), oldest first. Returns the versions the loads
        reported and how many published versions were reaped; raises `RefitError` on a bad ack."""

        done: list[int] = []
        n = 0
        while self._pending:
            version, sent, loads, acks = self._pending[0]
            if not block and not all(_done(r) for r in loads + acks):
                break
            self._pending.pop(0)
            for i, load in enumerate(loads):
                try:
                    done.append(wait_for(load, f"weight receiver {i}: load draft weights version {version}"))
                    if acks:
                        check_ack(
                            wait_for(acks[i], f"weight receiver {i}: refit proof of version {version}"),
                            version,
                            sent,
                        )
                except _actor_died():
                    continue  # killed: Ray restarts it and the loop gives it the current weights (loop/opd.py)
            n += 1
        return done, n

    def __len__(self) -> int:
        return len(self._pending)


class ObjectStoreWeightSync:
    def __init__(self, receivers: Sequence[Any], verify: bool = True) -> None:
        self.receivers = list(receivers)
        self.version = 0
        self.checks = RefitChecks(self.receivers, verify)

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        import ray

        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        self.checks.reap(block=False)
        sent = self.checks.sent(weights)
        ref = ray.put(weights)  # one copy; receivers on the node map the same shared memory
        loads = [rcv.load_draft_weights.remote(ref, version) for rcv in self.receivers]
        self.checks.add(version, sent, loads, self.receivers)
        self.version = version

    def wait(self) -> list[int]:
        return self.checks.reap(block=True)[0]

    def close(self, wait: bool = True) -> None:
        if wait:
            self.wait()

    def restarted(self, receiver: Any) -> None:
        pass  # every version is read afresh from the object store


class SharedFileWeightSync:
    """All receivers on the publisher's node (module docstring). Receivers need `load_draft_weights_file`."""

    def __init__(self, receivers: Sequence[Any], directory: str | None = None, verify: bool = True) -> None:
        import tempfile

        base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        remove_stale_slots(base)
        self.dir = tempfile.mkdtemp(prefix=f"{SLOT_PREFIX}{os.getpid()}_", dir=base)
        self.receivers = list(receivers)
        self.version = 0
        self.checks = RefitChecks(self.receivers, verify)
        self._paths: list[str] = []  # the slot file of each pending version, in publication order
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
        sent = self.checks.sent(weights)
        write_safetensors(path, weights)
        loads = [r.load_draft_weights_file.remote(path, version) for r in self.receivers]
        self.checks.add(version, sent, loads, self.receivers)
        self._paths.append(path)
        self.version = version

    @property
    def slots(self) -> int:
        """Slot files made so far (2 when receivers keep up: one being read, one being written)."""
        return self._slots

    def _reap(self, block: bool) -> list[int]:
        """Versions whose loads and acks are all back are checked; their slot files are free again."""
        try:
            done, _ = self.checks.reap(block)
        finally:  # a failed check still frees nothing that a receiver reads
            n = len(self._paths) - len(self.checks)
            self._free += self._paths[:n]
            self._paths = self._paths[n:]
        return done

    def wait(self) -> list[int]:
        return self._reap(block=True)

    def restarted(self, receiver: Any) -> None:
        pass  # every version is a file path: nothing lives in the receiver

    def close(self, wait: bool = True) -> None:
        import shutil

        try:
            if wait:
                self.wait()
        finally:  # a failed refit check, or a crash on the way out, still frees the shared memory
            shutil.rmtree(self.dir, ignore_errors=True)


SLOT_PREFIX = "draft_opd_ray_sync_"  # + the publishing process's pid + "_": whose slots a folder holds


def remove_stale_slots(base: str) -> list[str]:
    """Remove the slot folders in ``base`` whose publishing process is gone (a run killed before its `close`);
    returns their names. A live process's folders are left alone."""
    import re
    import shutil

    gone = []
    for name in sorted(os.listdir(base)):
        m = re.fullmatch(rf"{SLOT_PREFIX}(\d+)_.*", name)
        if m is None or _alive(int(m.group(1))):
            continue
        shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _done(ref: Any) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)
