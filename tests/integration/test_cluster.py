"""The run's Ray cluster, for real: an unreachable head and a plan the live nodes cannot hold fail with one line
(exit 2) before any model loads; the storage probe; the reservation binds each bundle to its plan node; a Ray
job on a 2-node cluster on this machine (`launch/local_cluster.sh`) writes its run under the storage dir; a
4-job Hydra multirun against that one cluster leaves no actor or placement group behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from draft_opd_ray.errors import ClusterError
from tests import helpers

pytestmark = [pytest.mark.ray]

SCRIPT = helpers.REPO / "launch" / "local_cluster.sh"
HEAD_PORT, DASHBOARD_PORT = 6590, 8295  # not the script's defaults: a cluster someone started keeps running


@dataclass
class LocalCluster:
    address: str  # GCS host:port (RAY_ADDRESS for a run)
    dashboard: str  # job server
    storage: Path
    env: dict[str, str]  # what the script and the runs need


def _script(cmd: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), cmd], env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    """Two 1-CPU nodes on this machine, started and stopped with the script (a short state dir: Ray's socket
    paths must stay short)."""
    state = Path(tempfile.mkdtemp(prefix="dorc", dir="/tmp"))
    env = dict(
        os.environ,
        LOCAL_CLUSTER_DIR=str(state),
        HEAD_PORT=str(HEAD_PORT),
        DASHBOARD_PORT=str(DASHBOARD_PORT),
        WORKER_PORTS="34000",
        DRAFT_OPD_STORAGE_DIR=str(state / "storage"),
    )
    try:
        r = _script("start", env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"export RAY_ADDRESS=127.0.0.1:{HEAD_PORT}" in r.stdout
        yield LocalCluster(
            f"127.0.0.1:{HEAD_PORT}", f"http://127.0.0.1:{DASHBOARD_PORT}", state / "storage", env
        )
    finally:
        r = _script("stop", env)
        left = subprocess.run(["pgrep", "-f", str(state / "ray")], capture_output=True, text=True).stdout
        shutil.rmtree(state, ignore_errors=True)
        assert r.returncode == 0 and not left.strip(), r.stdout + r.stderr + left


@pytest.fixture
def joined(local_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """This test process as a driver of the local cluster."""
    import ray

    ray.init(address=local_cluster.address, namespace="test_cluster", include_dashboard=False)
    try:
        yield local_cluster
    finally:
        ray.shutdown()


def error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one `error: ...` line of a failed run (Ray's own INFO lines may come before it; no traceback)."""
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.rstrip().endswith(errors[0])
    return errors[0]


def test_unreachable_head_exits_2_with_one_line_within_the_timeout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "stages=[opd]",
        "cluster.ray_address=127.0.0.1:1",
        "cluster.connect_timeout_s=5",
        "wandb.mode=disabled",
    ]
    t0 = time.monotonic()  # start-up alone (interpreter, Hydra, validation): a dry run of the same command
    assert helpers.run_main(*args, "dry_run=true", f"hydra.run.dir={run_dir}_dry").returncode == 0
    t1 = time.monotonic()
    r = helpers.run_main(*args, f"hydra.run.dir={run_dir}", RAY_ADDRESS="")
    took, startup = time.monotonic() - t1, t1 - t0
    line = error_line(r)
    assert "127.0.0.1:1" in line and "within 5 s" in line
    assert took < startup + 5 + 20, (took, startup)  # the timeout, not Ray's minutes of retries
    assert "[data]" not in r.stdout and not (run_dir / "draft_init").exists()  # nothing loaded


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["cluster.num_nodes=3"], "cluster.num_nodes: the plan needs 3 node(s) but the Ray cluster at"),
        (
            ["cluster.cpus_per_node=2", "cluster.cpus_per_rollout=0.6"],
            "cluster.cpus_per_node: the plan puts 1.85 CPU(s) on node 0 (rollout #0, rollout #1, replay #0, "
            "replay #1, learner #0) but Ray node 0 (",
        ),
    ],
)
def test_a_plan_the_cluster_cannot_hold_exits_2_with_one_line(
    local_cluster: LocalCluster, tmp_path: Path, overrides: list[str], expect: str
) -> None:
    run_dir = local_cluster.storage / "runs" / tmp_path.name
    r = helpers.run_main(
        "+cluster=cpu_2node",
        "stages=[opd]",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        *overrides,
        timeout=180,
        **{**local_cluster.env, "RAY_ADDRESS": local_cluster.address},
    )
    assert expect in error_line(r)
    assert "[data]" not in r.stdout


def test_storage_probe_sees_a_shared_dir_and_names_a_missing_one(joined: LocalCluster) -> None:
    from draft_opd_ray.cluster import check_storage

    check_storage(str(joined.storage), 60)
    assert not [p for p in joined.storage.iterdir() if p.name.startswith(".probe-")]  # cleaned up
    with pytest.raises(
        ClusterError, match=r"^cluster.storage_dir: on node \S+ \(\w+\): /nonexistent/x does not exist$"
    ):
        check_storage("/nonexistent/x", 60)


def test_reservation_binds_bundles_to_the_plan_nodes(joined: LocalCluster) -> None:
    import ray
    from ray.util.state import list_placement_groups

    from draft_opd_ray.cluster import live_nodes, reserve
    from draft_opd_ray.config.store import compose
    from draft_opd_ray.placement import plan_for

    plan = plan_for(compose(["+cluster=cpu_2node"]))
    nodes = live_nodes(ray.nodes())
    res = reserve(plan, 60)
    pg_id = res.pg.id.hex()
    try:
        assert res.node_id("rollout", 0) == nodes[0].node_id and nodes[0].head
        assert res.node_id("learner", 1) == nodes[1].node_id

        @ray.remote
        class Where:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

        for role, idx in (("replay", 1), ("learner", 0)):
            a = Where.options(**res.options(role, idx)).remote()  # type: ignore[attr-defined]
            assert ray.get(a.node.remote()) == res.node_id(role, idx)
            ray.kill(a)
        with pytest.raises(
            ClusterError, match="^cluster.reserve_timeout_s: the plan's 6 actors were not placed"
        ):
            reserve(plan, 2)  # the first reservation holds the CPUs
    finally:
        res.release()
        res.release()
    states = {
        p.placement_group_id: p.state for p in list_placement_groups(address=joined.address, detail=True)
    }
    assert states[pg_id] == "REMOVED"


def tiny_eval_overrides(target: Path, draft: Path) -> list[str]:
    return [
        "stages=[eval]",
        f"target.path={target}",
        f"draft.path={draft}",
        "data.eval.max_prompts=2",
        "eval.baselines=[]",
        "eval.max_new_tokens=8",
        "eval.concurrency=[1]",
        "wandb.mode=disabled",
    ]


@pytest.fixture(scope="module")
def tiny_draft(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    out = tmp_path_factory.mktemp("draft") / "draft"
    return save_eagle3(init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2]), out, tiny_target)


@pytest.mark.slow
@pytest.mark.vllm
def test_ray_job_succeeds_with_its_run_under_the_storage_dir(
    local_cluster: LocalCluster, tiny_target: Path, tiny_draft: Path
) -> None:
    job = f"test-job-{int(time.time())}"
    r = subprocess.run(
        ["bash", str(helpers.REPO / "launch" / "submit_ray_job.sh"), "+cluster=cpu_2node"]
        + tiny_eval_overrides(tiny_target, tiny_draft),
        env={**local_cluster.env, "RAY_ADDRESS": local_cluster.dashboard, "SUBMISSION_ID": job},
        cwd=helpers.REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert r.returncode == 0 and f"[job] {job}: SUCCEEDED" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = local_cluster.storage / "jobs" / job
    assert (run_dir / "eval" / "report.json").is_file() and (run_dir / "metrics.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_four_job_multirun_on_one_cluster_leaves_nothing_behind(
    local_cluster: LocalCluster, tiny_target: Path, tiny_draft: Path
) -> None:
    """Four opd jobs of one sweep, one after the other on the running cluster, each in its own namespace: four
    run dirs under the storage dir, and afterwards no actor alive and no placement group left."""
    sweep = local_cluster.storage / "sweep"
    r = helpers.run_main(
        "-m",
        "+cluster=cpu_2node",
        "stages=[opd]",
        f"target.path={tiny_target}",
        f"draft.path={tiny_draft}",
        "draft.aux_layer_ids=[0,1,2]",
        "cluster.rollout_engines=1",
        "cluster.replay_actors=1",
        "cluster.learner_ranks=1",
        "opd.steps=1",
        "rollout.prompts_per_round=2",
        "rollout.max_new_tokens=8",
        "data.train.max_prompts=4",
        "wandb.mode=disabled",
        "seed=0,1,2,3",
        f"hydra.sweep.dir={sweep}",
        timeout=2400,
        **{**local_cluster.env, "RAY_ADDRESS": local_cluster.address},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "checkpoints" / "opd" / "latest").is_symlink())
    assert len(runs) == 4
    import ray
    from ray.util.state import list_actors, list_placement_groups

    ray.init(address=local_cluster.address, namespace="test_cluster_after", include_dashboard=False)
    try:
        actors = list_actors(address=local_cluster.address, detail=True, limit=1000)
        pgs = list_placement_groups(address=local_cluster.address, detail=True, limit=1000)
        alive = [a for a in actors if a.state != "DEAD" and a.class_name != "JobSupervisor"]
        held = [p for p in pgs if p.state != "REMOVED"]
        namespaces = {a.ray_namespace for a in actors if a.class_name == "RolloutWorker"}
    finally:
        ray.shutdown()
    assert not alive and not held, (alive, held)
    assert len(namespaces) == 4  # one per job


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_two_node_run_places_every_slot_where_the_plan_says(
    local_cluster: LocalCluster, tiny_target: Path, tiny_draft: Path
) -> None:
    """`+cluster=cpu_2node`, 3 Draft-OPD steps on the tiny target: 2 rollout workers, 2 replay actors and 2 learner
    ranks, each on the node the dry run printed (Ray's state API), a data-parallel group of 2, both replay actors
    scoring, and nothing left running afterwards."""
    import json

    import ray
    from ray.util.state import list_actors, list_placement_groups

    from draft_opd_ray.cluster import live_nodes
    from draft_opd_ray.config.store import compose
    from draft_opd_ray.placement import plan_for

    run_dir = local_cluster.storage / "runs" / "two_node"
    overrides = [
        "+cluster=cpu_2node",
        "stages=[opd]",
        f"target.path={tiny_target}",
        f"draft.path={tiny_draft}",
        "draft.aux_layer_ids=[0,1,2]",
        "opd.steps=3",
        "rollout.prompts_per_round=2",
        "rollout.max_new_tokens=16",
        "data.train.max_prompts=8",
        "wandb.mode=disabled",
    ]
    env = {**local_cluster.env, "RAY_ADDRESS": local_cluster.address}
    r = helpers.run_main(*overrides, f"hydra.run.dir={run_dir}", timeout=1500, **env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x.get("stage") == "opd" and "loss" in x]
    assert len(steps) == 3 and {x["learner_world_size"] for x in steps} == {2}
    assert all(sum(x.get(f"replay{i}_seqs", 0) for x in steps) > 0 for i in (0, 1))

    plan = plan_for(compose(overrides[:1]))
    ray.init(address=local_cluster.address, namespace="test_cluster_two_node", include_dashboard=False)
    try:
        nodes = [n.node_id for n in live_nodes(ray.nodes())]
        actors = list_actors(address=local_cluster.address, detail=True, limit=1000)
        pgs = list_placement_groups(address=local_cluster.address, detail=True, limit=1000)
    finally:
        ray.shutdown()
    from draft_opd_ray.cluster import namespace_for

    ours = [a for a in actors if a.ray_namespace == namespace_for(run_dir)]  # this run's, not earlier tests'
    assert ours
    for cls, role in (("RolloutWorker", "rollout"), ("ReplayActor", "replay"), ("Learner", "learner")):
        ran = sorted(a.node_id for a in ours if a.class_name == cls)
        want = sorted(nodes[s.node] for s in plan.of(role))
        assert ran == want, (cls, ran, want)
    assert not [a for a in ours if a.state != "DEAD"]
    assert not [p for p in pgs if p.state != "REMOVED"]
