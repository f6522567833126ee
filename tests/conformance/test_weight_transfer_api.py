"""The vLLM weight-transfer API as our NCCL refit calls it (`rollout/engine.py`: `nccl_init`,
`load_draft_weights_nccl`; `sync/nccl.py`: `NcclSender`), bound against the installed signatures:
`vllm/entrypoints/rl/offline.py` (the `LLM` methods), `vllm/distributed/weight_transfer/nccl_common.py`
(`NCCLWeightTransferInitInfo`, `stateless_init_process_group`), `.../nccl_engine.py`
(`NCCLWeightTransferUpdateInfo`), `.../packed_tensor.py` (`packed_nccl_broadcast_producer`) and the worker
methods the engine's collective RPCs name (`vllm/v1/worker/gpu_worker.py`, our `sync/receiver.py`).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from draft_opd_ray.rollout.engine import SpecDecodeEngine
from draft_opd_ray.sync.nccl import nccl_plan


class _LLMCalls:
    """Records every method call made on an engine's `llm`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))

        return call


def test_engine_weight_transfer_calls_bind_to_vllm() -> None:
    """vllm/entrypoints/rl/offline.py, vllm/entrypoints/llm.py, nccl_common.py / nccl_engine.py, gpu_worker.py:
    every `LLM` call of `nccl_init` / `load_draft_weights_nccl` binds to the method's signature, the init and
    update dicts build vLLM's NCCL info dataclasses, and every collective RPC names a worker method."""
    from vllm import LLM
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.v1.worker.gpu_worker import Worker

    from draft_opd_ray.sync.receiver import DraftWeightExtension

    engine = object.__new__(SpecDecodeEngine)
    engine.llm = _LLMCalls()  # type: ignore[assignment]
    plan = nccl_plan({"fc.weight": torch.zeros(4, 8, dtype=torch.bfloat16), "norm.weight": torch.zeros(8)})
    engine.nccl_init("10.0.0.1", 29500, rank_offset=1, world_size=3)
    engine.load_draft_weights_nccl(plan, version=2)
    calls = engine.llm.calls  # type: ignore[attr-defined]
    order = [
        "init_weight_transfer_engine",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
    assert [c[0] for c in calls if c[0] in order] == order
    info = {c[0]: c[1][0] for c in calls if c[0] in ("init_weight_transfer_engine", "update_weights")}
    for name, args, kwargs in calls:
        inspect.signature(getattr(LLM, name)).bind(None, *args, **kwargs)
        if name == "collective_rpc":
            method = args[0]
            assert callable(getattr(DraftWeightExtension, method, None)) or callable(getattr(Worker, method))
    init = NCCLWeightTransferInitInfo(**info["init_weight_transfer_engine"]["init_info"])
    assert (init.master_address, init.master_port, init.rank_offset, init.world_size) == (
        "10.0.0.1",
        29500,
        1,
        3,
    )
    update = NCCLWeightTransferUpdateInfo(**info["update_weights"]["update_info"])
    assert update.names == ["fc.weight", "norm.weight"] and update.dtype_names == ["bfloat16", "float32"]
    for rpc in order:
        assert callable(getattr(Worker, rpc)), rpc  # what the LLM methods call on every worker


def test_sender_calls_bind_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm/distributed/weight_transfer/nccl_common.py (`stateless_init_process_group`), packed_tensor.py
    (`packed_nccl_broadcast_producer`): `NcclSender`'s calls bind to the installed signatures (CUDA's presence
    and device index are faked; no group forms, nothing is sent)."""
    import vllm.distributed.weight_transfer.nccl_common as common
    import vllm.distributed.weight_transfer.packed_tensor as packed

    from draft_opd_ray.sync.nccl import NcclSender

    bound: dict[str, inspect.BoundArguments] = {}

    def recorder(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            bound[name] = inspect.signature(real).bind(*args, **kwargs)
            return object()

        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    for mod, name in ((common, "stateless_init_process_group"), (packed, "packed_nccl_broadcast_producer")):
        monkeypatch.setattr(mod, name, recorder(name, getattr(mod, name)))
    sender = NcclSender("10.0.0.1", 29500, 3)
    sender.send({"fc.weight": torch.zeros(2, 2)})
    init = bound["stateless_init_process_group"].arguments
    assert (init["master_address"], init["master_port"], init["rank"], init["world_size"]) == (
        "10.0.0.1",
        29500,
        0,
        3,
    )
    assert bound["packed_nccl_broadcast_producer"].arguments["src"] == 0
