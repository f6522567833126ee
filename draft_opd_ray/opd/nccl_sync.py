"""NCCL weight sync for GPU clusters: the learner's rank 0 broadcasts the draft straight into every engine rank.

Behind the `WeightSync` interface (`opd/weight_sync.py`), with vLLM's weight-transfer API doing the receiving:
every rollout engine is started with `weight_transfer_config={"backend": "nccl"}`, joins one NCCL group with the
learner (`init_weight_transfer_engine`: the learner is rank 0, engine e's tensor-parallel ranks follow the
previous engines'), and takes a version as `start_draft_weight_update` -> `update_weights` (the receive side of
the broadcast, loaded through the draft's own `load_weights` in vLLM's layerwise reload) ->
`finish_weight_update`. The tensors go in checkpoint names (`Learner.rollout_state`), packed into vLLM's
broadcast buffers; the plan (names, dtypes, shapes) travels by Ray. After each version the engines return the
refit proof (`opd/refit.py`) like the file transports, checked when the sync reaps them. Receivers that are not
vLLM engines (the replay actor's draft copy in `replay.mode=redraft`) take the object-store path.

A broadcast is a collective: the learner's send returns only once every engine has entered its receive, which an
engine does after the round it is generating. So unlike the file transports the learner's next publication
waits for the workers' rounds; the rounds themselves never wait.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from draft_opd_ray.errors import ConfigError
from draft_opd_ray.opd.weight_sync import ObjectStoreWeightSync, RefitChecks
from draft_opd_ray.waits import wait_for

TRANSPORTS = ("auto", "shm_file", "object_store", "nccl")


def weight_sync_kind(choice: str, num_nodes: int, gpus_per_node: int) -> str:
    """`rollout.weight_sync` resolved: ``auto`` = NCCL where the cluster has GPUs, else a shared-memory file on
    one node and Ray's object store across nodes. An explicit ``nccl`` on a cluster without GPUs is refused."""
    if choice not in TRANSPORTS:
        raise ConfigError(f"rollout.weight_sync: must be one of {list(TRANSPORTS)}, got {choice!r}")
    if choice == "auto":
        if gpus_per_node > 0:
            return "nccl"
        return "shm_file" if num_nodes == 1 else "object_store"
    if choice == "nccl" and gpus_per_node == 0:
        raise ConfigError("rollout.weight_sync: nccl needs GPUs (cluster.gpus_per_node is 0)")
    return choice


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
    object store (the replay actor's draft copy)."""

    def __init__(
        self,
        engines: Sequence[Any],
        sender: Any,
        tensor_parallel: Sequence[int],
        others: Sequence[Any] = (),
        verify: bool = True,
    ) -> None:

        self.engines, self.sender = list(engines), sender
        self.version = 0
        self.others = ObjectStoreWeightSync(others, verify) if others else None
        self.checks = RefitChecks(self.engines, verify)
        offsets = rank_offsets(tensor_parallel)
        world = 1 + sum(tensor_parallel)
        address, port = wait_for(sender.nccl_endpoint.remote(), "learner rank 0: NCCL endpoint")
        joins = [e.nccl_init.remote(address, port, o, world) for e, o in zip(self.engines, offsets)]
        wait_for(
            [sender.nccl_open.remote(address, port, world), *joins], "learner rank 0 and engines: NCCL group"
        )

    def publish(self, version: int, weights: dict[str, Any]) -> None:
        if version <= self.version:
            raise ValueError(f"weight versions must increase: got {version} after {self.version}")
        self.checks.reap(block=False)
        sent = self.checks.sent(weights)
        plan = nccl_plan(weights)
        loads = [e.load_draft_weights_nccl.remote(plan, version) for e in self.engines]
        self.checks.add(version, sent, loads, self.engines)
        self.sender.nccl_send.remote()  # its completion shows in the engines' loads
        if self.others is not None:
            self.others.publish(version, weights)
        self.version = version

    def wait(self) -> list[int]:
        done = self.checks.reap(block=True)[0]
        if self.others is not None:
            done += self.others.wait()
        return done

    def close(self, wait: bool = True) -> None:
        if wait:
            self.wait()
