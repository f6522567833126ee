"""The pure parts of `draft_opd_ray.cluster` and the storage checks of the config: node mapping, the fit check's
messages, addresses, namespaces, run dirs under cluster.storage_dir. No Ray cluster starts here."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from draft_opd_ray.cluster import (
    LiveNode,
    Reservation,
    fit_problem,
    host_port,
    live_nodes,
    namespace_for,
    resolve_address,
    wait_reachable,
)
from draft_opd_ray.config.schema import ClusterConfig
from draft_opd_ray.config.store import compose
from draft_opd_ray.errors import ClusterError, ConfigError
from draft_opd_ray.placement import build_plan, plan_for
from draft_opd_ray.preflight import check_run_dir, validate


def ray_node(node_id: str, cpus: float, head: bool = False, alive: bool = True, gpus: float = 0) -> dict:
    res = {
        "CPU": cpus,
        **({"GPU": gpus} if gpus else {}),
        **({"node:__internal_head__": 1.0} if head else {}),
    }
    return {"NodeID": node_id, "NodeManagerAddress": "10.0.0.1", "Alive": alive, "Resources": res}


def test_nodes_map_head_first_then_by_node_id() -> None:
    nodes = live_nodes(
        [ray_node("cc", 4), ray_node("ff", 4, head=True), ray_node("aa", 4), ray_node("00", 4, alive=False)]
    )
    assert [n.node_id for n in nodes] == ["ff", "aa", "cc"]  # the dead node is left out
    assert nodes[0].head and not nodes[1].head


def two_node_plan() -> object:
    return plan_for(compose(["+cluster=cpu_2node"]))


def test_cpu_2node_plan_uses_both_nodes_and_fits_two_one_cpu_nodes() -> None:
    plan = two_node_plan()
    assert {s.node for s in plan.slots} == {0, 1}  # type: ignore[attr-defined]
    nodes = live_nodes([ray_node("a", 1, head=True), ray_node("b", 1)])
    assert fit_problem(plan, nodes) is None  # type: ignore[arg-type]


def test_too_few_nodes_is_one_line_naming_the_counts() -> None:
    msg = fit_problem(two_node_plan(), live_nodes([ray_node("a", 8, head=True)]), "10.0.0.1:6379")  # type: ignore[arg-type]
    assert msg is not None and "\n" not in msg
    assert (
        msg.startswith("cluster.num_nodes: the plan needs 2 node(s)") and "10.0.0.1:6379 has 1 alive" in msg
    )


def test_a_node_too_small_for_its_actors_is_named_with_them() -> None:
    plan = two_node_plan()  # node 0: 2 rollout (0.25) + 2 replay (0.2) = 0.9 CPU
    msg = fit_problem(plan, live_nodes([ray_node("a", 0.5, head=True), ray_node("b", 1)]))  # type: ignore[arg-type]
    assert msg is not None and "\n" not in msg
    assert msg.startswith("cluster.cpus_per_node: the plan puts 0.9 CPU(s) on node 0")
    assert "rollout #0, rollout #1, replay #0, replay #1" in msg and "has 0.5" in msg


def test_gpus_are_checked_per_node() -> None:
    plan = build_plan(
        ClusterConfig(num_nodes=1, gpus_per_node=4, cpus_per_node=8, rollout_engines=1, replay_actors=1),
        draft_kind="eagle3",
        zero_stage=0,
    )
    assert fit_problem(plan, [LiveNode("a", "h", True, {"CPU": 8, "GPU": 4})]) is None
    msg = fit_problem(plan, [LiveNode("a", "h", True, {"CPU": 8, "GPU": 2})])
    assert msg is not None and msg.startswith("cluster.gpus_per_node: the plan puts 3 GPU(s) on node 0")


def test_reservation_maps_roles_to_bundles_and_refuses_unknown_slots() -> None:
    plan = two_node_plan()
    slots = [s for s in plan.slots if s.role != "driver"]  # type: ignore[attr-defined]
    res = Reservation(None, slots, [f"node{s.node}" for s in slots], plan.bundles())  # type: ignore[attr-defined]
    assert res.bundle("learner", 1) == 5 and res.node_id("learner", 1) == "node1"
    assert res.node_id("rollout", 0) == "node0"
    with pytest.raises(ClusterError, match="no replay #7"):
        res.bundle("replay", 7)
    res.release()  # nothing reserved: a no-op, and again
    res.release()


def test_namespace_is_one_per_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert namespace_for("a") == namespace_for(tmp_path / "a")
    assert namespace_for("a") != namespace_for("b")
    assert namespace_for(None) != namespace_for(None)
    assert namespace_for("a").startswith("draft_opd_")


def test_address_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(None) is None and resolve_address("local") is None
    assert resolve_address("10.0.0.2:6379") == "10.0.0.2:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.3:6379")  # what a Ray job's entrypoint gets: it wins
    assert resolve_address(None) == "10.0.0.3:6379" and resolve_address("auto") == "10.0.0.3:6379"


def test_host_port_forms() -> None:
    assert host_port("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert host_port("ray://head:10001") == ("head", 10001)
    with pytest.raises(ClusterError, match="dashboard"):
        host_port("http://head:8265")
    with pytest.raises(ClusterError, match="not host:port"):
        host_port("head")


def test_unreachable_head_fails_within_the_timeout_with_one_line() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as e:
            wait_reachable(f"127.0.0.1:{port}", 1.0)
        assert time.monotonic() - t0 < 3.0
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "cluster.connect_timeout_s" in msg


def test_reachable_head_returns_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        wait_reachable(f"127.0.0.1:{s.getsockname()[1]}", 5.0)


def test_multi_node_needs_a_storage_dir() -> None:
    with pytest.raises(ConfigError, match="^cluster.storage_dir: a 2-node cluster needs"):
        validate(compose(["+cluster=2x8xH100", "cluster.storage_dir=null"]))
    assert validate(compose(["+cluster=2x8xH100"]))  # the shipped group names one (DRAFT_OPD_STORAGE_DIR)
    with pytest.raises(ConfigError, match="^cluster.storage_dir: must be an absolute path"):
        compose(["cluster.storage_dir=shared"])


def test_storage_dir_sets_the_cache_and_holds_the_run_dir(tmp_path: Path) -> None:
    assert compose().cache_dir is None  # one node, no storage dir: as before
    cfg = compose([f"cluster.storage_dir={tmp_path}"])
    assert cfg.cache_dir == f"{tmp_path}/cache"
    assert compose([f"cluster.storage_dir={tmp_path}", "cache_dir=/elsewhere"]).cache_dir == "/elsewhere"
    check_run_dir(cfg, tmp_path / "outputs" / "run1")
    with pytest.raises(ConfigError, match="^hydra.run.dir: .* is not under cluster.storage_dir"):
        check_run_dir(cfg, "/somewhere/else")
    check_run_dir(compose(), "/somewhere/else")  # no storage dir: any run dir
