"""The server's NCCL refit (`serve/transfer.py`) as it calls vLLM's `AsyncLLM` weight-transfer API, bound against the
installed signatures (vllm/v1/engine/async_llm.py: `init_weight_transfer_engine`, `shutdown_weight_transfer_engine`,
`start_draft_weight_update`, `update_weights`, `finish_weight_update`, `collective_rpc`), its requests
(vllm/distributed/weight_transfer/base.py) carrying the NCCL backend's init and update info (nccl_common.py,
nccl_engine.py), and the flag the engine is started with (`--weight-transfer-config`, parsed by vLLM's own server
parser). The learner's rank 0 is a stand-in whose calls are awaited as Ray's are; no group forms (no GPU here)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import torch

from draft_opd_ray.config.schema import Config
from draft_opd_ray.serve.transfer import NcclRefit


class _AsyncLLM:
    """Records every call the NCCL path makes on the server's engine client, bound to `AsyncLLM`'s signature."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.requests = log, {}

    def __getattr__(self, name: str) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        real = getattr(AsyncLLM, name)
        assert inspect.iscoroutinefunction(real), name

        async def call(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(real).bind(None, *args, **kwargs)
            self.log.append(name if name != "collective_rpc" else f"rpc {args[0]}")
            if args:
                self.requests[name] = args[0]
            return [None]

        return call


class _Rank0:
    """The learner's rank 0 as a Ray actor handle: ``method.remote(...)`` returns an awaitable."""

    def __init__(self, log: list[str], name: str = "rank0") -> None:
        self.log, self.name = log, name

    def __getattr__(self, method: str) -> Any:
        log, name = self.log, self.name

        class Handle:
            @staticmethod
            def remote(*args: Any) -> Any:
                log.append(f"{name}.{method}")

                async def done() -> Any:
                    return ("10.0.0.1", 29500) if method == "nccl_endpoint" else None

                return asyncio.ensure_future(done())

        return Handle()


def test_a_candidate_goes_through_vllms_draft_weight_transfer_in_order() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.v1.worker.gpu_worker import Worker

    from draft_opd_ray.sync.receiver import DraftWeightExtension

    log: list[str] = []
    client = _AsyncLLM(log)
    weights = {"fc.weight": torch.zeros(4, 8, dtype=torch.bfloat16), "norm.weight": torch.zeros(8)}

    async def main() -> NcclRefit:
        refit = NcclRefit(client, _Rank0(log), tensor_parallel=2, timeout_s=30)
        await refit.load(weights, 1)
        await refit.load(weights, 2)  # the group is formed once
        refit.sender_changed(_Rank0(log, "new_rank0"))  # a restarted learner: a new group
        await refit.load(weights, 3)
        return refit

    refit = asyncio.run(main())
    one = [
        "start_draft_weight_update",
        "rank0.nccl_send",
        "update_weights",
        "finish_weight_update",
        "rpc set_draft_version",
    ]
    join = ["rank0.nccl_endpoint", "shutdown_weight_transfer_engine", "rank0.nccl_open"]
    assert log[:4] == [*join, "init_weight_transfer_engine"]
    assert log[4:14] == one + one
    assert log[14:18] == [*(x.replace("rank0", "new_rank0") for x in join), "init_weight_transfer_engine"]
    assert log[18:] == [x.replace("rank0", "new_rank0") for x in one] and refit.groups == 2
    init, update = client.requests["init_weight_transfer_engine"], client.requests["update_weights"]
    assert isinstance(init, WeightTransferInitRequest) and isinstance(update, WeightTransferUpdateRequest)
    info = NCCLWeightTransferInitInfo(**init.init_info)
    assert (info.master_address, info.master_port, info.rank_offset, info.world_size) == (
        "10.0.0.1",
        29500,
        1,
        3,
    )
    plan = NCCLWeightTransferUpdateInfo(**update.update_info)
    assert plan.names == ["fc.weight", "norm.weight"] and plan.dtype_names == ["bfloat16", "float32"]
    assert callable(DraftWeightExtension.set_draft_version)
    for rpc in (
        "init_weight_transfer_engine",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(Worker, rpc)), rpc  # what AsyncLLM calls on every worker


def test_the_nccl_engine_flag_is_one_vllms_server_parser_takes() -> None:
    from draft_opd_ray.serve.server import vllm_args, vllm_argv

    cfg = Config()
    cfg.target.max_model_len = 512
    spec = {"method": "eagle3", "model": "/models/draft", "num_speculative_tokens": 3}
    args = vllm_args(vllm_argv(cfg, "/models/target", spec, capture_features=True, nccl=True))
    got = args.weight_transfer_config
    assert (got["backend"] if isinstance(got, dict) else got.backend) == "nccl"
    assert (
        vllm_args(vllm_argv(cfg, "/models/target", spec, capture_features=True)).weight_transfer_config
        is None
    )
