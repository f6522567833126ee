"""The torch.distributed process group that DeepSpeed needs, set up and released in one place."""

from __future__ import annotations

import os
import socket

_ENV = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def resolve_backend(backend: str) -> str:
    """`learner.backend`: auto = nccl where CUDA is available, gloo otherwise."""
    if backend != "auto":
        return backend
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str = "auto") -> None:
    """A process group of one on a fresh free port. Always a fresh port: a Ray actor inherits the driver's
    environment, whose MASTER_PORT may still be bound (e.g. by the sft stage's group)."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    )
    deepspeed.init_distributed(dist_backend=resolve_backend(backend))


def release_process_group() -> None:
    """Destroy the group and forget its rendezvous, so that later groups (Ray actors) start clean."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k in _ENV:
        os.environ.pop(k, None)
