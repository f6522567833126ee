"""NCCL weight sync for GPU clusters: the learner's rank 0 broadcasts the draft straight into every engine rank.

Behind the `WeightSync` interface (`sync/weight_sync.py`), with vLLM's weight-transfer API doing the receiving:
every rollout engine is started with `weight_transfer_config={"backend": "nccl"}`, joins one NCCL group with the
learner (`init_weight_transfer_engine`: the learner is rank 0, engine e's tensor-parallel ranks follow the
previous engines'), and takes a version as `start_draft_weight_update` -> `update_weights` (the receive side of
the broadcast, loaded through the draft's own `load_weights` in vLLM's layerwise reload) ->
`finish_weight_update`. The tensors go in checkpoint names (`Learner.rollout_state`), packed into vLLM's
broadcast buffers; the plan (names, dtypes, shapes) travels by Ray. After each version the engines return the
refit proof (`sync/refit.py`) like the file transports, checked when the sync reaps them. Receivers that are not
vLLM engines (the replay actor's draft copy in `replay.mode=redraft`) take the object-store path.

A broadcast is a collective: the learner's send returns only once every engine has entered its receive, which an
engine does after the round it is generating. So unlike the file transports the learner's next publication
waits for the workers' rounds; the rounds themselves never wait.

Failures. The sender's send is a Ray call the sync keeps and checks whenever it reaps (`publish`, `wait`,
`close`): a failed send raises at once, not after the engines' receives time out (they never finish without it).
An engine whose load failed while the send is still pending leaves the broadcast one rank short: after a short
grace the sync raises `RunError` instead of waiting on the collective.

A restarted engine (Ray restarts a killed rollout worker, `cluster.max_restarts`) re-forms the group. An NCCL
communicator has a fixed membership: vLLM 0.32's `NCCLWeightTransferEngine` builds one `PyNcclCommunicator` per
`init_weight_transfer_engine` and destroys it in `shutdown_weight_transfer_engine`; the restarted engine's
workers start with none, and the survivors' and the sender's group still counts the dead ranks, so the next
broadcast in it would wait for ever. Sending that one engine files instead does not help: the old group's world
still holds its ranks. So after the loop has given the restarted engine the current weights (`restarted`, by
the object-store path), the next `publish` first lets the pending broadcasts finish, then opens a new endpoint;
the sender and every engine drop the old communicator and join the new one (this waits for the engines'
rounds, like a broadcast). What cannot be recovered: an engine that dies with a broadcast pending that it never
received. The sender's call is then stuck inside NCCL, and vLLM 0.32 offers no way to abort a receive from
outside the engine core, so `restarted` raises `RunError` at once (the last checkpoint is kept; a resume
continues) rather than hang until `cluster.actor_timeout_s`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from draft_opd_ray.errors import ConfigError, RunError
from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, RefitChecks
from draft_opd_ray.waits import timeout_s, wait_for

if TYPE_CHECKING:
    from draft_opd_ray.placement import PlacementPlan

TRANSPORTS = ("auto", "shm_file", "object_store", "nccl")


def weight_sync_kind(choice: str, num_nodes: int, gpus_per_node: int, shared_gpu: str = "") -> str:
    """`rollout.weight_sync` resolved: ``auto`` = NCCL where the cluster has GPUs, else a shared-memory file on
    one node and Ray's object store across nodes. ``shared_gpu``: where the placement puts the learner's rank 0
    and an engine rank on one GPU (`sender_shared_gpu`); NCCL refuses two ranks on one device ("Duplicate GPU
    detected"), so ``auto`` takes a file transport there. An explicit ``nccl`` is refused on a cluster without
    GPUs or on a shared GPU."""
    if choice not in TRANSPORTS:
        raise ConfigError(f"rollout.weight_sync: must be one of {list(TRANSPORTS)}, got {choice!r}")
    if choice == "auto":
        if gpus_per_node > 0 and not shared_gpu:
            return "nccl"
        return "shm_file" if num_nodes == 1 else "object_store"
    if choice == "nccl" and gpus_per_node == 0:
        raise ConfigError("rollout.weight_sync: nccl needs GPUs (cluster.gpus_per_node is 0)")
    if choice == "nccl" and shared_gpu:
        raise ConfigError(
            f"rollout.weight_sync: nccl cannot broadcast between ranks on one GPU, and the placement puts "
            f"{shared_gpu}; use auto (a file transport here) or give the learner its own GPU"
        )
    return choice


def sender_shared_gpu(plan: PlacementPlan) -> str:
    """Where the plan puts the learner's rank 0 (the NCCL sender) on a GPU that a rollout engine also uses, in
    words ("learner rank 0 and rollout engine 0 on GPU 0 of node 0"); "" when it has a GPU of its own."""
    from draft_opd_ray.placement import LEARNER, ROLLOUT

    sender = next((s for s in plan.of(LEARNER) if s.index == 0), None)
    if sender is None or not sender.gpus:
        return ""
    for engine in plan.of(ROLLOUT):
        both = sorted(set(engine.gpus) & set(sender.gpus)) if engine.node == sender.node else []
        if both:
            return f"learner rank 0 and rollout engine {engine.index} on GPU {both[0]} of node {engine.node}"
    return ""


def plan_weight_sync(choice: str, plan: PlacementPlan) -> str:
    """`weight_sync_kind` for the placement plan (the same plan the dry run prints and the actors start from)."""
    return weight_sync_kind(choice, plan.num_nodes, plan.gpus_per_node, sender_shared_gpu(plan))


def nccl_plan(weights: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    """vLLM's `NCCLWeightTransferUpdateInfo` fields for one version: what every receiver allocates and loads, in
    the order the sender broadcasts (the state's order)."""
    return {
        "names": list(weights),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
    }


def require_cuda(role: str) -> None:
    """A one-line error where NCCL cannot run: this process sees no CUDA device."""
    if not torch.cuda.is_available():
        raise ConfigError(
            f"rollout.weight_sync: nccl needs a CUDA device in the {role}, and it has none "
            "(use shm_file on one node or object_store)"
        )


def free_endpoint() -> tuple[str, int]:
    """This node's address and a free TCP port for the group's rendezvous."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    return ray.util.get_node_ip_address(), port


class NcclSender:
    """The sending end, held by the learner's rank 0 (`Learner.nccl_open` / `nccl_send`)."""

    def __init__(self, address: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        require_cuda("learner")
        self.group = stateless_init_process_group(address, port, 0, world_size, torch.cuda.current_device())

    def close(self) -> None:
        """Drop the communicator (the group is re-formed when an engine restarted)."""
        self.group.destroy()

    def send(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Broadcast ``weights`` in `nccl_plan` order, packed like vLLM's receiving side expects."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        dev = torch.device("cuda", torch.cuda.current_device())
        packed_nccl_broadcast_producer(
            iterator=((n, t.to(dev, non_blocking=True)) for n, t in weights.items()),
            group=self.group,
            src=0,
            post_iter_func=lambda item: item[1],
        )
        torch.cuda.synchronize()


def rank_offsets(tensor_parallel: Sequence[int]) -> list[int]:
    """The first NCCL rank of each engine: the sender is rank 0, then every engine's ranks in turn."""
    out, nxt = [], 1
    for tp in tensor_parallel:
        out.append(nxt)
        nxt += tp
    return out


class NcclWeightSync:
    """`WeightSync` over NCCL (module docstring). ``engines``: rollout workers started with
    ``weight_transfer="nccl"``; ``sender``: the learner actor (rank 0); ``others``: receivers that take the
    object store (the replay actor's draft copy). ``grace_s``: how long a pending send may still finish once an
    engine's load of its version failed (the engine may have died after its receive)."""

    def __init__(
        self,
        engines: Sequence[Any],
        sender: Any,
        tensor_parallel: Sequence[int],
        others: Sequence[Any] = (),
        verify: bool = True,
        grace_s: float = 60.0,
    ) -> None:
        self.engines, self.sender = list(engines), sender
        self.tensor_parallel = list(tensor_parallel)
        self.version = 0
        self.grace_s = grace_s
        self.others = ObjectStoreWeightSync(others, verify) if others else None
        self.checks = RefitChecks(self.engines, verify)
        self._sends: list[tuple[int, Any, list[Any]]] = []  # (version, the sender's send, the engines' loads)
        self._regroup = False
        self.groups = 0  # NCCL groups formed so far (1 + one per re-forming after restarts)
        self._form_group()

    def _form_group(self) -> None:
        """A new endpoint; the sender and every engine drop their old communicator (if any) and join this one."""
        world = 1 + sum(self.tensor_parallel)
        address, port = wait_for(self.sender.nccl_endpoint.remote(), "learner rank 0: NCCL endpoint")
        joins = [
            e.nccl_init.remote(address, port, o, world)
            for e, o in zip(self.engines, rank_offsets(self.tensor_parallel))
        ]
        wait_for(
            [self.sender.nccl_open.remote(address, port, world), *joins],
            "learner rank 0 and engines: NCCL group",
        )
        self.groups += 1
        self._regroup = False

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        self._check_sends(block=False)
        if self._regroup:  # an engine restarted: finish the old group's broadcasts, then a new group
            self._check_sends(block=True)
            self.checks.reap(block=True)
            self._form_group()
        self.checks.reap(block=False)
        sent = self.checks.sent(weights)
        plan = nccl_plan(weights)
        loads = [e.load_draft_weights_nccl.remote(plan, version) for e in self.engines]
        self.checks.add(version, sent, loads, self.engines)
        self._sends.append((version, self.sender.nccl_send.remote(), loads))
        if self.others is not None:
            self.others.publish(version, weights)
        self.version = version

    def restarted(self, receiver: Any) -> None:
        """``receiver`` was restarted by Ray (the loop gives it the current weights next): the next `publish`
        re-forms the group. Raises `RunError` when it died before receiving a broadcast still pending."""
        if not any(receiver == e for e in self.engines):
            return  # the replay actor's copy: the object store needs nothing
        i = next(j for j, e in enumerate(self.engines) if receiver == e)
        for version, send, loads in self._sends:
            self._settle(version, send, loads, block=False, died=i)
        self._check_sends(block=False)
        self._regroup = True

    def _check_sends(self, block: bool) -> None:
        """Raise the sender's error of every finished send, oldest first; a pending send whose version an engine
        failed to load gets ``grace_s`` to finish, then raises. With ``block`` wait for every send."""
        while self._sends:
            version, send, loads = self._sends[0]
            if not self._settle(version, send, loads, block):
                return
            self._sends.pop(0)

    def _settle(
        self, version: int, send: Any, loads: list[Any], block: bool, died: int | None = None
    ) -> bool:
        """Whether the send of ``version`` finished (raises its error if it failed). Waits on the send and the
        loads together: a failed load (or engine ``died``) with the send still pending raises after the grace."""
        import ray

        deadline = time.monotonic() + (timeout_s() if block else 0.0)
        calls = [send, *loads]
        while True:
            ready, waiting = ray.wait(calls, num_returns=len(calls), timeout=0)
            if send in ready:
                _sender_result(send, version)
                return True
            failed = [i for i, ref in enumerate(loads) if ref in ready and _failed(ref)]
            if died is not None and died not in failed:
                ray.wait([loads[died]], timeout=self.grace_s)  # its queued load fails with the actor
                failed += [died] if _failed(loads[died]) else []
            if failed:
                if ray.wait([send], timeout=self.grace_s)[0]:
                    _sender_result(send, version)
                    return True
                raise RunError(
                    f"rollout engine {failed[0]} did not receive weight version {version} "
                    f"({_first_line(loads[failed[0]])}), so the learner's NCCL broadcast of it cannot complete "
                    "(vLLM cannot abort it). The last complete checkpoint is kept: resume=<run dir> continues "
                    "from it"
                )
            if not block:
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunError(
                    f"learner rank 0: NCCL broadcast of weight version {version}: no answer in "
                    f"{timeout_s():.0f} s (cluster.actor_timeout_s); the sender or an engine is stuck. The last "
                    "complete checkpoint is kept: resume=<run dir> continues from it"
                )
            ray.wait(waiting, num_returns=1, timeout=min(left, 1.0))

    def wait(self) -> list[int]:
        self._check_sends(block=True)
        done = self.checks.reap(block=True)[0]
        if self.others is not None:
            done += self.others.wait()
        return done

    def close(self, wait: bool = True) -> None:
        if wait:
            self.wait()


def _sender_result(send: Any, version: int) -> None:
    """The finished send's error, raised as one line naming the version."""
    import ray

    try:
        ray.get(send, timeout=0)
    except Exception as e:  # the sender's own error (RayTaskError wraps it) or its actor's death
        raise RunError(
            f"learner rank 0: NCCL send of weight version {version} failed: {_first_line(send, e)}"
        ) from e


def _failed(ref: Any) -> bool:
    """Whether the finished call ``ref`` raised."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception:
        return True
    return False


def _first_line(ref: Any, err: BaseException | None = None) -> str:
    """The last line of a finished call's error (Ray's traceback ends with the original exception)."""
    import ray

    if err is None:
        try:
            ray.get(ref, timeout=0)
            return "no error"
        except Exception as e:
            err = e
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(err).__name__
