"""The engine arguments our code hands to `vllm.LLM` (captured by a recorder in its place: no engine starts),
as vLLM's `EngineArgs` (`vllm/engine/arg_utils.py`) reads them: a recording engine turns async scheduling off,
a tensor-parallel one asks for the multiprocessing executor, ``dtype=auto`` is resolved where the engine runs,
and evaluation serves the target as the rollout engines do (its dtype, TP size and GPU memory share).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.config.schema import Config
from tests.conformance.conftest import Captured
from tests.helpers import spec_engine


def _engine(**kw: Any) -> None:
    spec_engine("t", "ngram", None, 3, **kw)


def test_recording_and_tensor_parallel_arguments(llm_calls: Any) -> None:
    """vllm/engine/arg_utils.py (`async_scheduling`, `distributed_executor_backend`): recording => async
    scheduling off, not recording => vLLM's default (no setting); TP > 1 => "mp", TP 1 => vLLM's choice."""
    from vllm.engine.arg_utils import EngineArgs

    _engine(record=True, tensor_parallel=2)
    _engine(record=False)
    (_, rec), (_, plain) = llm_calls.calls
    assert rec["async_scheduling"] is False and rec["distributed_executor_backend"] == "mp"
    assert rec["scheduler_cls"] == "draft_opd_ray.rollout.vllm_ext.AnchorRecordingScheduler"
    assert "async_scheduling" not in plain and "distributed_executor_backend" not in plain
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(rec) <= fields and set(plain) <= fields  # every argument is one vLLM takes


def test_auto_dtype_is_resolved_where_the_engine_runs(
    llm_calls: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm/config/model.py takes a concrete dtype; ``auto`` (ours: bfloat16 where it is fast) is resolved in
    the engine's process, so a GPU node's engine gets bfloat16 whatever the driver's node has."""
    import draft_opd_ray.device as device

    for fast, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(device, "fast_bfloat16", lambda fast=fast: fast)
        _engine(dtype="auto")
        assert llm_calls.calls[-1][1]["dtype"] == want
    _engine(dtype="float16")
    assert llm_calls.calls[-1][1]["dtype"] == "float16"


def test_eval_engine_serves_the_target_as_the_rollout_does(
    tiny_pair: tuple[Path, Path], llm_calls: Any, tmp_path: Path
) -> None:
    """vllm/engine/arg_utils.py (`dtype`, `tensor_parallel_size`, `gpu_memory_utilization`): the driver's eval
    stage builds its engines with `target.dtype`, `cluster.rollout_tensor_parallel` and
    `rollout.gpu_memory_utilization` (it used vLLM's float32 default, TP 1 and 0.5)."""
    from draft_opd_ray.driver import eval_stage

    target, draft = tiny_pair
    cfg = Config()
    cfg.target = dataclasses.replace(
        cfg.target, dtype="bfloat16", max_model_len=256
    )  # sized, as run() sizes it
    cfg.rollout = dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.85)
    cfg.cluster = dataclasses.replace(cfg.cluster, rollout_tensor_parallel=2)
    llm_calls.stop = True
    with pytest.raises(Captured):
        eval_stage(cfg, str(target), str(draft), None, {"set": [[1, 2, 3]]}, (2,), tmp_path, None)  # type: ignore[arg-type]
    ((model, kw),) = llm_calls.calls
    assert model == str(target)
    assert (kw["dtype"], kw["tensor_parallel_size"], kw["gpu_memory_utilization"]) == ("bfloat16", 2, 0.85)
    assert kw["max_model_len"] == 256
    assert kw["distributed_executor_backend"] == "mp" and kw["async_scheduling"] is False
