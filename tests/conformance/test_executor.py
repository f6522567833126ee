"""Which executor a tensor-parallel engine gets inside a rollout worker, a Ray actor in the run's placement group.

vLLM's `ParallelConfig` (`vllm/config/parallel.py`, `__post_init__`) picks its Ray executor for world size > 1
whenever Ray is initialised and the caller sits in a placement group; the Ray executor
(`vllm/v1/executor/ray_utils.py`, `initialize_ray_cluster`) then refuses any bundle with more than one GPU,
which is exactly the bundle our plan gives a TP engine (`draft_opd_ray/placement.py`). The actor already owns
its GPUs, so the engine asks for the multiprocessing executor (`vllm/v1/executor/multiproc_executor.py`).
Ray is faked at its two questions (initialised? current placement group?): no cluster starts.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from draft_opd_ray.config.schema import ClusterConfig
from draft_opd_ray.placement import ROLLOUT, build_plan
from tests.helpers import spec_engine

TP = 2


@pytest.fixture
def in_actor_in_pg(monkeypatch: pytest.MonkeyPatch, cuda_like: Any) -> Any:
    """A CUDA-like platform with TP GPUs visible (the actor's), Ray initialised, and the current placement group
    the run's: one bundle per actor, the TP engine's with TP GPUs."""
    import ray
    import ray.util
    import vllm.config.parallel
    import vllm.platforms

    plan = build_plan(
        ClusterConfig(gpus_per_node=8, rollout_engines=1, rollout_tensor_parallel=TP, cpus_per_node=32),
        draft_kind="eagle3",
        zero_stage=2,
    )
    pg = types.SimpleNamespace(bundle_specs=plan.bundles(), id="pg")
    assert plan.bundles(ROLLOUT) == [{"CPU": 0.4, "GPU": float(TP)}]
    platform = cuda_like(TP)
    monkeypatch.setattr(vllm.config.parallel, "current_platform", platform)
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: pg)
    return pg


def test_vllm_default_is_the_ray_executor_which_refuses_our_bundle(in_actor_in_pg: Any) -> None:
    """vllm/config/parallel.py (backend selection), vllm/v1/executor/ray_utils.py (`initialize_ray_cluster`): the
    default for TP 2 in our actor is "ray", and the Ray executor rejects the actor's {"GPU": 2} bundle."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor import ray_utils

    cfg = ParallelConfig(tensor_parallel_size=TP)
    assert cfg.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="Placement group bundle cannot have more than 1 GPU"):
        ray_utils.initialize_ray_cluster(cfg)


def test_our_tp_engine_gets_the_multiprocessing_executor(in_actor_in_pg: Any, llm_calls: Any) -> None:
    """vllm/config/parallel.py, vllm/v1/executor/abstract.py (`Executor.get_class`): the arguments
    `SpecDecodeEngine` passes for TP 2 keep "mp" in the same actor (vLLM accepts it as given) and select
    `MultiprocExecutor`; a one-GPU engine leaves the choice to vLLM ("uni")."""
    from vllm.config import ParallelConfig
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    for tp in (TP, 1):
        spec_engine("t", "none", None, 3, tensor_parallel=tp)
    (_, two), (_, one) = llm_calls.calls
    assert two["distributed_executor_backend"] == "mp" and "distributed_executor_backend" not in one
    cfg = ParallelConfig(
        tensor_parallel_size=two["tensor_parallel_size"],
        distributed_executor_backend=two["distributed_executor_backend"],
    )
    assert cfg.distributed_executor_backend == "mp"
    assert Executor.get_class(types.SimpleNamespace(parallel_config=cfg)) is MultiprocExecutor  # type: ignore[arg-type]
    assert (
        ParallelConfig(tensor_parallel_size=one["tensor_parallel_size"]).distributed_executor_backend == "uni"
    )
