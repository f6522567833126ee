"""The placement plan fits each cluster exactly: every actor placed, no GPU given twice, no node oversubscribed."""

from __future__ import annotations

from collections import Counter

import pytest

from draft_opd_ray.config.store import compose
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.placement import build_plan, plan_for


@pytest.mark.parametrize("cluster", ["local", "8xA100", "2x8xH100"])
def test_plan_fits_cluster_exactly(cluster: str) -> None:
    cfg = compose([f"+cluster={cluster}"])
    c = cfg.cluster
    plan = plan_for(cfg)
    roles = Counter(s.role for s in plan.slots)
    assert roles == {
        "rollout": c.rollout_engines,
        "replay": c.replay_actors,
        "learner": c.learner_ranks,
        "driver": 1,
    }
    for node in range(c.num_nodes):
        on_node = [s for s in plan.slots if s.node == node]
        gpus = [g for s in on_node for g in s.gpus]
        assert len(gpus) == len(set(gpus)), f"GPU given twice on node {node}"
        assert all(0 <= g < c.gpus_per_node for g in gpus)
        assert sum(s.cpus for s in on_node) <= c.cpus_per_node + 1e-9
    # GPU clusters are configured to use every GPU; TP engines stay inside one node.
    assert plan.gpus_used() == c.num_nodes * c.gpus_per_node
    for s in plan.of("rollout"):
        assert len(s.gpus) == (c.rollout_tensor_parallel if c.gpus_per_node else 0)
    for s in plan.of("replay") + plan.of("learner"):
        assert len(s.gpus) == (1 if c.gpus_per_node else 0)
    text = plan.render()
    for word in (
        "rollout",
        "replay",
        "learner",
        "driver",
        "tensor_parallel_size",
        "ZeRO stage",
        "data-parallel size",
    ):
        assert word in text


def test_local_plan_uses_fractional_cpus_only() -> None:
    plan = plan_for(compose())
    assert plan.gpus_used() == 0
    assert sum(s.cpus for s in plan.slots) <= 2.0 + 1e-9
    assert plan.bundles("rollout") == [{"CPU": 0.4}, {"CPU": 0.4}]
    # the placement group: one bundle per actor in plan order, the driver outside it
    actors = [s for s in plan.slots if s.role != "driver"]
    assert plan.bundles() == [{"CPU": s.cpus} for s in actors] and len(actors) == len(plan.slots) - 1


def test_gpu_bundles_match_plan() -> None:
    plan = plan_for(compose(["+cluster=2x8xH100"]))
    assert plan.bundles("rollout") == [{"CPU": 16.0, "GPU": 2.0}] * 4
    assert plan.bundles("learner") == [{"CPU": 8.0, "GPU": 1.0}] * 4


def test_plan_is_built_from_the_cluster_node() -> None:
    cfg = compose(["+cluster=8xA100"])
    plan = build_plan(cfg.cluster, draft_kind=cfg.draft.kind, zero_stage=cfg.learner.zero_stage)
    assert plan == plan_for(cfg) and plan.cluster == "8xA100"


def test_plan_reports_shortfall() -> None:
    with pytest.raises(ConfigError, match="cannot place replay #0 .*free per node: node 0: 4 GPU"):
        plan_for(compose(["+cluster=8xA100", "cluster.cpus_per_replay=80"]))


def test_one_gpu_shared_by_every_role() -> None:
    """`+cluster=gpu_shared`: fractional GPU shares on one GPU, bundles asking for exactly those shares."""
    plan = plan_for(compose(["+cluster=gpu_shared"]))
    assert [(s.role, s.gpus, s.share) for s in plan.slots if s.role != "driver"] == [
        ("rollout", (0,), 0.5),
        ("replay", (0,), 0.25),
        ("learner", (0,), 0.25),
    ]
    assert plan.bundles() == [{"CPU": 2.0, "GPU": 0.5}, {"CPU": 2.0, "GPU": 0.25}, {"CPU": 2.0, "GPU": 0.25}]
    assert plan.gpus_used() == 1 and "0 (0.5)" in plan.render()


def test_shares_fill_the_fullest_gpu_that_fits() -> None:
    """Best fit: shares pack onto partly used GPUs before a fresh one; a share larger than any GPU's rest fails."""
    cfg = compose(
        [
            "+cluster=gpu_shared",
            "cluster.gpus_per_node=2",
            "cluster.replay_actors=2",
            "cluster.gpus_per_replay=0.5",
            "cluster.cpus_per_node=16",
        ]
    )
    plan = plan_for(cfg)
    assert [s.gpus for s in plan.slots if s.role != "driver"] == [(0,), (0,), (1,), (1,)]
    with pytest.raises(ConfigError, match="need 2.25 GPUs"):
        plan_for(compose(["+cluster=gpu_shared", "cluster.replay_actors=3", "cluster.gpus_per_replay=0.5"]))


@pytest.mark.parametrize(
    "override, key",
    [("cluster.gpus_per_replay=0", "gpus_per_replay"), ("cluster.gpus_per_learner=1.5", "gpus_per_learner")],
)
def test_gpu_shares_are_checked(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        compose([override])


def test_cpu_threads_of_replay_and_learner() -> None:
    """`cluster.cpu_threads=auto`: a replay actor keeps off the cores its node's engines are bound to, a learner
    rank takes them all, each split between the actors of its role on the node; `one` and GPU clusters: None."""
    from draft_opd_ray.device import node_threads
    from draft_opd_ray.loop.actors import cpu_share

    cfg = compose([])
    plan = plan_for(cfg)
    (replay,), (learner,) = plan.of("replay"), plan.of("learner")
    assert cpu_share(cfg, plan, replay) == (cfg.cluster.rollout_engines, 1)
    assert cpu_share(cfg, plan, learner) == (0, 1)
    two = compose(["+cluster=cpu_2node"])
    plan2 = plan_for(two)
    for s in plan2.of("replay"):
        assert cpu_share(two, plan2, s) == (2, 2)  # both engines and both replay actors sit on node 0
    for s in plan2.of("learner"):
        assert cpu_share(two, plan2, s) == (0, 2)
    one = compose(["cluster.cpu_threads=one"])
    assert cpu_share(one, plan_for(one), replay) is None
    gpu = compose(["+cluster=8xA100"])
    assert all(cpu_share(gpu, plan_for(gpu), s) is None for s in plan_for(gpu).of("learner"))
    cores = node_threads()
    assert cores >= 1 and node_threads(reserved=cores) == 1 == node_threads(reserved=cores + 5)
    assert node_threads(sharers=2) == max(1, cores // 2)
