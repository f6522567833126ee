"""The torch.distributed process group that DeepSpeed needs, set up and released in one place.

One rank (the default): a group of one on a fresh free port. Several ranks (the learner's data-parallel group
across Ray actors): rank 0 reports its node's address and a free port (`rendezvous_address`), the driver hands
it to every rank, and each calls `init_process_group(backend, rank=r, world_size=n, master=(addr, port))`.
How a batch is split between ranks (or actors) by cost: `balanced_shards`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

_ENV = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def resolve_backend(backend: str) -> str:
    """`learner.backend`: auto = nccl where CUDA is available, gloo otherwise."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_address() -> str:
    """This node's address as other nodes reach it (Ray's view when inside Ray, else loopback)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return "127.0.0.1"


def rendezvous_address() -> tuple[str, int]:
    """(address, free port) of this process's node: what rank 0 gives every rank of a new group."""
    return node_address(), free_port()


def init_process_group(
    backend: str = "auto",
    *,
    rank: int = 0,
    world_size: int = 1,
    master: tuple[str, int] | None = None,
) -> None:
    """Join (or make) the process group. One rank without ``master``: always a fresh loopback port, because a
    Ray actor inherits the driver's environment, whose MASTER_PORT may still be bound (the sft stage's group).
    Ray sets CUDA_VISIBLE_DEVICES per actor, so LOCAL_RANK is 0 in every actor."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if master is None:
        if world_size != 1:
            raise ValueError("a process group of several ranks needs the rendezvous address of rank 0")
        master = ("127.0.0.1", free_port("127.0.0.1"))
    os.environ.update(
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE=str(world_size),
    )
    from draft_opd_ray.logs import into_log

    with into_log():  # DeepSpeed prints that its communication op was built
        deepspeed.init_distributed(dist_backend=resolve_backend(backend))


def world() -> tuple[int, int]:
    """(rank, world size) of the current group; (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum ``values`` over the group's ranks (float64 on the group's device); as given with one rank."""
    import torch
    import torch.distributed as dist

    if world()[1] == 1:
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.cpu()]


def release_process_group() -> None:
    """Destroy the group and forget its rendezvous, so that later groups (Ray actors) start clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:  # DeepSpeed caches the world group it made on the destroyed one: forget it too
        import deepspeed.utils.groups as ds_groups

        ds_groups._WORLD_GROUP = None
        ds_groups._DATA_PARALLEL_GROUP = None
    except (ImportError, AttributeError):  # pragma: no cover - another DeepSpeed layout
        pass
    for k in _ENV:
        os.environ.pop(k, None)


def balanced_shards(weights: Sequence[float], parts: int) -> list[list[int]]:
    """Indices 0..len(weights)-1 split into ``parts`` shards of about equal total weight (longest first onto the
    lightest shard), each in ascending order; shards may be empty when there are fewer items than parts. How the
    SFT ranks, the replay actors and the learner ranks share a batch."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0.0] * parts
    shards: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(weights)), key=lambda j: (-weights[j], j)):
        s = min(range(parts), key=lambda p: (load[p], p))
        shards[s].append(i)
        load[s] += weights[i]
    return [sorted(s) for s in shards]
