"""A local Ray started on the learner's GPUs alone (`cluster.connect(gpus=...)`, as `serve` starts it beside vLLM's
engine) hands its actors those ids and no other: real Ray, the GPU ids only resources (no GPU is touched), and this
process's CUDA_VISIBLE_DEVICES (the engine's) as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from draft_opd_ray.config.schema import Config
from draft_opd_ray.serve.placement import split_gpus, visible_gpus


@pytest.mark.ray
def test_a_local_ray_on_the_learners_gpus_gives_its_actors_those_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from draft_opd_ray import cluster

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,5,6")  # the engine would take 0
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = Config()
    cfg.cluster.cpus_per_node = 2
    split = split_gpus(visible_gpus(cfg), 1, {"replay": 1.0, "learner": 1.0})
    assert split.ray == ["5", "6"]
    assert cluster.connect(cfg, tmp_path, gpus=split.ray)
    try:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,5,6"  # the engine's process sees what it saw

        @ray.remote(num_cpus=0, num_gpus=1)
        class Actor:  # held alive together: each keeps its GPU
            def devices(self) -> str:
                return os.environ.get("CUDA_VISIBLE_DEVICES", "")

        assert ray.cluster_resources().get("GPU") == 2
        actors = [Actor.remote(), Actor.remote()]  # type: ignore[attr-defined]
        assert sorted(ray.get([a.devices.remote() for a in actors])) == ["5", "6"]
    finally:
        ray.shutdown()
