"""How a candidate reaches the server's engine on GPUs: vLLM's own draft weight-transfer path, backend NCCL.

When the learner's side has GPUs of its own (`serve/placement.py`: not the engine's), the server's engine is started
with `--weight-transfer-config '{"backend": "nccl"}'` and a candidate goes from the learner rank's GPU straight into
every engine rank: the learner's rank 0 and the engine's ranks form one NCCL group once (`AsyncLLM.
init_weight_transfer_engine`, the learner rank 0, the engine's tensor-parallel ranks after it), then each version is
`start_draft_weight_update` -> `update_weights` (the receiving side of the learner's broadcast, `Learner.nccl_send`)
-> `finish_weight_update` on the server's `AsyncLLM`, in the process that owns it (no development endpoint). The
refit proof follows as for every refit. NCCL refuses two ranks on one GPU, so where the learner shares the engine's
GPU, and on CPU, the file transport of our worker extension is the path (`Refitter._load_and_prove`); so is it for a
rollback or an undo, whose weights come from a folder, not from the learner.

A learner restarted (its actor died) is a new sender: the group is formed again at the next candidate, the
engine's old communicator dropped first (`shutdown_weight_transfer_engine`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.serve.placement import GpuSplit

BACKEND = {"backend": "nccl"}


def server_transport(cfg: Config, split: GpuSplit | None) -> str:
    """`rollout.weight_sync` for a server: "nccl" where the learner's side has GPUs of its own (`auto`), or where
    asked for; else "file" (our extension's file transport). Asking for nccl where it cannot run (no GPU, or the
    engine's GPU shared) is a ConfigError. With no split (CPU, or the actors on a joined Ray cluster, where nothing
    says whether they share the engine's GPU) `auto` is the file transport."""
    from draft_opd_ray.sync.nccl import weight_sync_kind

    choice = cfg.rollout.weight_sync
    if split is None:
        kind = weight_sync_kind(choice, 1, cfg.cluster.gpus_per_node)
        return "nccl" if choice == "nccl" and kind == "nccl" else "file"
    shared = f"the learner's side and the engine on GPU {split.engine[0]}" if split.shared else ""
    return "nccl" if weight_sync_kind(choice, 1, cfg.cluster.gpus_per_node, shared) == "nccl" else "file"


class NcclRefit:
    """The engine side of the NCCL path: ``client`` the server's `AsyncLLM`, ``sender`` the learner's rank 0 (a Ray
    actor: its calls are awaited), ``tensor_parallel`` the engine's ranks."""

    def __init__(self, client: Any, sender: Any, tensor_parallel: int, timeout_s: float) -> None:
        self.client, self.sender, self.world = client, sender, 1 + tensor_parallel
        self.timeout_s = timeout_s
        self.joined = False
        self.groups = 0  # groups formed (1 + one per learner restart that sent again)

    def sender_changed(self, sender: Any) -> None:
        """A restarted learner: its rank 0 is a new process, so the next `load` forms a new group."""
        self.sender, self.joined = sender, False

    async def _join(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        address, port = await self.sender.nccl_endpoint.remote()
        await self.client.shutdown_weight_transfer_engine()  # a group of a learner that died: dropped
        opened = self.sender.nccl_open.remote(address, port, self.world)  # the rendezvous needs both sides
        info = {
            "master_address": address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": self.world,
            "packed": True,
        }
        await asyncio.wait_for(
            self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)), self.timeout_s
        )
        await asyncio.wait_for(opened, self.timeout_s)
        self.joined = True
        self.groups += 1

    async def load(self, weights: Mapping[str, Any], version: int) -> None:
        """The learner rank 0's current draft (``weights``: the same state, for the plan of names, dtypes and
        shapes) broadcast into every engine rank as ``version``."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from draft_opd_ray.sync.nccl import nccl_plan

        if not self.joined:
            await self._join()
        await self.client.start_draft_weight_update()
        sent = self.sender.nccl_send.remote()
        await asyncio.wait_for(
            self.client.update_weights(WeightTransferUpdateRequest(update_info=nccl_plan(weights))),
            self.timeout_s,
        )
        await self.client.finish_weight_update()
        await asyncio.wait_for(sent, self.timeout_s)
        await self.client.collective_rpc("set_draft_version", args=(version,))
