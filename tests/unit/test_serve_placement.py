"""Where a GPU server's pieces go (`serve/placement.py`): vLLM's engine on the first GPUs, the learner's side on the
others, or sharing the engine's when there are none; shares that do not fit refused before anything loads
(the local Ray started on the learner's GPUs: tests/integration/test_serve_gpu_split.py)."""

from __future__ import annotations

import pytest

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.serve.placement import learner_shares, split_gpus, visible_gpus

SHARED = {"replay": 0.25, "learner": 0.25, "guard": 0.25}  # +cluster=gpu_shared's shares
WHOLE = {"replay": 1.0, "learner": 1.0, "guard": 1.0}  # +cluster=8xA100's


def test_the_engine_takes_the_first_gpus_and_the_learner_the_rest() -> None:
    s = split_gpus([str(i) for i in range(8)], 1, WHOLE)
    assert s.engine == ["0"] and s.ray == [str(i) for i in range(1, 8)] and not s.shared
    s = split_gpus(["3", "5", "6"], 2, {"replay": 0.5, "learner": 0.5})
    assert s.engine == ["3", "5"] and s.ray == ["6"]
    assert (
        "on ['3', '5']; the learner's side (replay 0.5, learner 0.5 GPU) on ['6'], of their own"
        in s.describe()
    )


def test_one_gpu_is_shared_when_the_shares_are_fractions() -> None:
    s = split_gpus(["0"], 1, SHARED)
    assert s.engine == s.ray == ["0"] and s.shared and "sharing the engine's" in s.describe()


@pytest.mark.parametrize(
    ("visible", "tp", "shares", "names"),
    [
        (["0"], 1, WHOLE, "cluster.gpus_per_"),  # three whole GPUs on the engine's one
        (["0", "1", "2"], 1, WHOLE, "cluster.gpus_per_"),  # two GPUs left for three
        (["0", "1"], 1, {"replay": 0.5, "learner": 0.75}, "cluster.gpus_per_"),  # 1.25 of one GPU
        (["0"], 2, SHARED, "cluster.rollout_tensor_parallel"),
    ],
)
def test_shares_that_do_not_fit_are_one_config_error(
    visible: list[str], tp: int, shares: dict[str, float], names: str
) -> None:
    with pytest.raises(ConfigError) as e:
        split_gpus(visible, tp, shares)
    assert str(e.value).startswith(names) and "\n" not in str(e.value)


def test_the_visible_gpus_and_the_shares_come_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config()
    cfg.cluster.gpus_per_node, cfg.cluster.gpus_per_replay, cfg.cluster.gpus_per_learner = 4, 0.3, 0.6
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(cfg) == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 7")
    assert visible_gpus(cfg) == ["2", "7"]
    assert learner_shares(cfg) == {"replay": 0.3, "learner": 0.6, "guard": 0.3}
    cfg.serve.guard = False
    assert learner_shares(cfg) == {"replay": 0.3, "learner": 0.6}


def test_no_split_on_cpu_or_when_the_actors_join_a_ray_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from draft_opd_ray.serve.placement import serve_split

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = Config()
    assert serve_split(cfg) is None  # gpus_per_node 0
    cfg.cluster.gpus_per_node, cfg.cluster.gpus_per_replay, cfg.cluster.gpus_per_learner = 2, 0.3, 0.4
    split = serve_split(cfg)
    assert split is not None and split.engine == ["0"] and split.ray == ["1"]
    cfg.cluster.ray_address = "auto"  # a `ray start` cluster places them (and is not looked up here)
    assert serve_split(cfg) is None
    cfg.cluster.ray_address = None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert serve_split(cfg) is None


def test_the_servers_refit_transport_follows_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve/transfer.server_transport`: NCCL where the learner's side has GPUs of its own (auto), the file
    transport where it shares the engine's GPU or on CPU; nccl asked for where it cannot run is a ConfigError."""
    from draft_opd_ray.serve.transfer import server_transport

    cfg = Config()
    assert server_transport(cfg, None) == "file"  # CPU
    cfg.rollout.weight_sync = "nccl"
    with pytest.raises(ConfigError, match="rollout.weight_sync: nccl needs GPUs"):
        server_transport(cfg, None)
    cfg.cluster.gpus_per_node = 2
    own, shared = split_gpus(["0", "1"], 1, SHARED), split_gpus(["0"], 1, SHARED)
    for choice, split, want in (
        ("auto", own, "nccl"),
        ("auto", shared, "file"),
        ("shm_file", own, "file"),
        ("nccl", own, "nccl"),
        ("auto", None, "file"),  # a joined Ray cluster: nothing says the learner has a GPU of its own
        ("nccl", None, "nccl"),
    ):
        cfg.rollout.weight_sync = choice
        assert server_transport(cfg, split) == want, (choice, split)
    cfg.rollout.weight_sync = "nccl"
    with pytest.raises(ConfigError, match="the learner's side and the engine on GPU 0"):
        server_transport(cfg, shared)
