"""The Ray cluster a run uses: connect (local or join), check the shared storage, reserve the plan's actors.

    connect(cfg, run_dir)      local Ray, or join RAY_ADDRESS / cluster.ray_address; one namespace per run dir
    check_storage(dir, t)      every alive node writes a probe under cluster.storage_dir and reads the others'
    reserve(plan, t)           the plan checked against the live nodes, then one placement group whose bundle i
                               sits on the Ray node that the plan's node index maps to -> Reservation
    session(cfg, plan, rd)     all three around the stages; releases the group and shuts Ray down after

Node mapping (deterministic): plan node 0 is the head, the other alive nodes follow in node-id order. Bundle
``i`` (the i-th non-driver slot, plan order) is bound to its node by a label selector on ``ray.io/node-id``,
so what runs is what `dry_run=true` printed. Every failure here is one line (ClusterError) raised before any
model loads: an unreachable head within `cluster.connect_timeout_s`, a plan that does not fit the live nodes
at once, a group not ready within `cluster.reserve_timeout_s`, a storage dir some node does not see.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import ClusterError
from draft_opd_ray.logs import runtime_env
from draft_opd_ray.placement import DRIVER, PlacementPlan

NODE_ID_LABEL = "ray.io/node-id"
_HEAD_RESOURCE = "node:__internal_head__"


# --------------------------------------------------------------------------------------------------
# Connect
# --------------------------------------------------------------------------------------------------


def namespace_for(run_dir: str | os.PathLike[str] | None) -> str:
    """A Ray namespace unique to a run dir: jobs of one Hydra multirun on one cluster never share named actors."""
    key = str(Path(run_dir).resolve()) if run_dir is not None else uuid.uuid4().hex
    return "draft_opd_" + hashlib.sha1(key.encode()).hexdigest()[:16]


def resolve_address(configured: str | None) -> str | None:
    """The address to join, or None for a local Ray. RAY_ADDRESS wins (Ray's own rule; a Ray job sets it), then
    `cluster.ray_address`; "auto" is the cluster `ray start` last started on this machine."""
    addr = os.environ.get("RAY_ADDRESS") or configured
    if addr in (None, "", "local"):
        return None
    if addr == "auto":
        from ray._private.utils import read_ray_address

        found = read_ray_address()
        if not found:
            raise ClusterError(
                "cluster.ray_address: auto found no Ray cluster started with `ray start` on this machine; set "
                "RAY_ADDRESS=<head>:6379 or cluster.ray_address=<head>:6379"
            )
        return str(found)
    return addr


def host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``ray://host:port`` -> (host, port); ClusterError for anything else."""
    if address.startswith(("http://", "https://")):
        raise ClusterError(
            f"cluster.ray_address: {address} is a dashboard (job submission) address; give the head's GCS "
            "address host:port (port 6379 unless the head was started with another --port)"
        )
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"cluster.ray_address: {address!r} is not host:port (e.g. 10.0.0.1:6379 or auto)")
    return host, int(port)


def wait_reachable(address: str, timeout_s: float) -> None:
    """Retry a TCP connection to the head until it answers or `timeout_s` passes. Ray's own join retries for
    minutes and logs from C++ on every attempt; this fails within the timeout with one line."""
    host, port = host_port(address)
    deadline = time.monotonic() + timeout_s
    err: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(
                f"cluster.ray_address: no Ray head answers at {address} within {timeout_s:g} s "
                f"(cluster.connect_timeout_s){f': {err.strerror or err}' if err else ''}"
            )
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return
        except OSError as e:
            err = e
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))


def connect(
    cfg: Config, run_dir: str | os.PathLike[str] | None = None, gpus: list[str] | None = None
) -> bool:
    """Start a local Ray (`cluster.cpus_per_node` CPUs; with ``gpus``, on those GPU ids alone) or join RAY_ADDRESS
    / `cluster.ray_address`, in the namespace of ``run_dir``. Returns True when this call initialised Ray, so the
    caller must `ray.shutdown()` (which stops a local Ray and disconnects from a joined one, ending this run's
    actors); False when Ray was already initialised by the caller (then its namespace and address are the
    caller's)."""
    import ray

    if ray.is_initialized():
        return False
    address = resolve_address(cfg.cluster.ray_address)
    ns = namespace_for(run_dir)
    env = runtime_env()  # a quiet run's library logging in every worker (logs.py)
    if address is None:
        with visible_devices(gpus):  # Ray takes its GPU ids from this process's CUDA_VISIBLE_DEVICES at start
            ray.init(
                address="local",
                num_cpus=int(cfg.cluster.cpus_per_node),
                num_gpus=None if gpus is None else len(gpus),
                include_dashboard=False,
                namespace=ns,
                logging_level=logging.ERROR,  # its start-up notices are noise on stderr; the actors' logs still come
                runtime_env=env or None,
            )
        return True
    wait_reachable(address, cfg.cluster.connect_timeout_s)
    try:
        ray.init(address=address, namespace=ns, include_dashboard=False, runtime_env=env or None)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(f"cluster.ray_address: cannot join the Ray cluster at {address}: {e}") from None
    return True


@contextlib.contextmanager
def visible_devices(gpus: list[str] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to ``gpus`` inside the block (nothing changes with None), then as it was."""
    if gpus is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


# --------------------------------------------------------------------------------------------------
# The live nodes and the fit check (pure: tested without Ray)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveNode:
    node_id: str
    ip: str
    head: bool
    resources: dict[str, float] = field(default_factory=dict)  # total resources (CPU, GPU, ...)


def live_nodes(ray_nodes: list[dict[str, Any]]) -> list[LiveNode]:
    """`ray.nodes()` -> the alive nodes in plan order: the head first, then by node id."""
    alive = [
        LiveNode(
            node_id=n["NodeID"],
            ip=n.get("NodeManagerAddress", "?"),
            head=_HEAD_RESOURCE in n.get("Resources", {}),
            resources=dict(n.get("Resources", {})),
        )
        for n in ray_nodes
        if n.get("Alive", n.get("alive", False))
    ]
    return sorted(alive, key=lambda n: (not n.head, n.node_id))


def _slots(plan: PlacementPlan) -> list[Any]:
    return [s for s in plan.slots if s.role != DRIVER]


def fit_problem(plan: PlacementPlan, nodes: list[LiveNode], address: str = "the cluster") -> str | None:
    """What of the plan does not fit the live nodes' total resources (one line), or None. Contention (another
    run holding resources) is not a misfit: that shows as a placement group not ready in time."""
    if len(nodes) < plan.num_nodes:
        alive = ", ".join(f"{n.ip} {n.resources.get('CPU', 0):g} CPU" for n in nodes)
        return (
            f"cluster.num_nodes: the plan needs {plan.num_nodes} node(s) but the Ray cluster at {address} has "
            f"{len(nodes)} alive ({alive})"
        )
    slots, bundles = _slots(plan), plan.bundles()
    for i, node in enumerate(nodes[: plan.num_nodes]):
        mine = [(s, b) for s, b in zip(slots, bundles) if s.node == i]
        for res, key in (("CPU", "cpus_per_node"), ("GPU", "gpus_per_node")):
            need = sum(b.get(res, 0.0) for _, b in mine)
            have = node.resources.get(res, 0.0)
            if need > have + 1e-9:
                who = ", ".join(f"{s.role} #{s.index}" for s, b in mine if b.get(res))
                return (
                    f"cluster.{key}: the plan puts {need:g} {res}(s) on node {i} ({who}) but Ray node {i} "
                    f"({node.ip}, {node.node_id[:8]}) has {have:g}; lower the actor counts or their shares"
                )
    return None


# --------------------------------------------------------------------------------------------------
# Reserve
# --------------------------------------------------------------------------------------------------


@dataclass
class Reservation:
    """The plan's actors, reserved: bundle i is the i-th non-driver slot of the plan, on ``node_ids[i]``.

    Invariants: one bundle per non-driver slot, in plan order; each bundle on the Ray node its slot's plan node
    maps to; `release()` is idempotent (the group is removed once; later calls do nothing)."""

    pg: Any
    slots: list[Any]
    node_ids: list[str]  # Ray node id of each bundle
    bundles: list[dict[str, float]]  # `plan.bundles()`: what each bundle holds (CPU, GPU share)
    _index: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._index = {(s.role, s.index): i for i, s in enumerate(self.slots)}

    def bundle(self, role: str, index: int) -> int:
        try:
            return self._index[(role, index)]
        except KeyError:
            raise ClusterError(f"cluster: the placement plan has no {role} #{index}") from None

    def options(self, role: str, index: int) -> dict[str, Any]:
        """Ray actor options that put ``role`` #``index`` in its bundle (`.options(**res.options(...))`)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        i = self.bundle(role, index)
        return {
            "num_cpus": self.bundles[i]["CPU"],
            "num_gpus": self.bundles[i].get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
        }

    def node_id(self, role: str, index: int) -> str:
        return self.node_ids[self.bundle(role, index)]

    def release(self) -> None:
        if self.pg is None:
            return
        from ray.util.placement_group import remove_placement_group

        pg, self.pg = self.pg, None
        remove_placement_group(pg)


def _available(nodes: list[LiveNode]) -> str:
    import ray

    free = ray._private.state.available_resources_per_node()
    return ", ".join(
        f"node {i}: {free.get(n.node_id, {}).get('CPU', 0):g} CPU / {free.get(n.node_id, {}).get('GPU', 0):g} GPU"
        for i, n in enumerate(nodes)
    )


def reserve(plan: PlacementPlan, timeout_s: float) -> Reservation:
    """Check the plan against the live nodes, then one placement group with each bundle bound to its node;
    ClusterError (one line) for a misfit at once, or when the group is not ready within ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = live_nodes(ray.nodes())
    address = ray.get_runtime_context().gcs_address
    problem = fit_problem(plan, nodes, address)
    if problem:
        raise ClusterError(problem)
    slots = _slots(plan)
    node_ids = [nodes[s.node].node_id for s in slots]
    pg = placement_group(
        plan.bundles(),
        strategy="PACK",
        bundle_label_selector=[{NODE_ID_LABEL: nid} for nid in node_ids],
    )
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise ClusterError(
            f"cluster.reserve_timeout_s: the plan's {len(slots)} actors were not placed within {timeout_s:g} s "
            f"(free now: {_available(nodes)}); another run may hold the resources"
        ) from None
    return Reservation(pg, slots, node_ids, plan.bundles())


# --------------------------------------------------------------------------------------------------
# Shared storage
# --------------------------------------------------------------------------------------------------


def _probe_write(storage_dir: str, probe: str, node_id: str) -> str | None:
    """On one node: write its probe file; an error line when the dir is missing or not writable."""
    if not os.path.isdir(storage_dir):
        return f"{storage_dir} does not exist"
    try:
        os.makedirs(probe, exist_ok=True)
        Path(probe, node_id).write_text(node_id)
    except OSError as e:
        return f"cannot write under {storage_dir}: {e.strerror or e}"
    return None


def _probe_read(probe: str, node_ids: list[str]) -> list[str]:
    """On one node: the node ids whose probe it cannot read."""
    return [n for n in node_ids if not (Path(probe, n).is_file() and Path(probe, n).read_text() == n)]


def check_storage(storage_dir: str, timeout_s: float) -> None:
    """Every alive node writes a probe file under ``storage_dir`` (one zero-CPU task pinned to each node), then
    every node and the driver read every probe back; ClusterError names the first node that cannot."""
    import ray

    nodes = live_nodes(ray.nodes())
    probe = os.path.join(storage_dir, f".probe-{uuid.uuid4().hex[:12]}")
    ids = [n.node_id for n in nodes]
    try:
        wrote = _on_each(nodes, _probe_write, [(storage_dir, probe, n) for n in ids], timeout_s)
        for node, err in zip(nodes, wrote):
            if err:
                raise ClusterError(f"cluster.storage_dir: on node {node.ip} ({node.node_id[:8]}): {err}")
        missing = [("the driver", m) for m in _probe_read(probe, ids)]
        for node, unseen in zip(nodes, _on_each(nodes, _probe_read, [(probe, ids)] * len(nodes), timeout_s)):
            missing += [(f"node {node.ip} ({node.node_id[:8]})", m) for m in unseen]
        if missing:
            who, m = missing[0]
            raise ClusterError(
                f"cluster.storage_dir: {storage_dir} is not shared: {who} does not see the probe written by "
                f"node {m[:8]}; mount one shared directory at the same path on every node"
            )
    finally:  # on every node: a dir that is not shared leaves one probe per node
        _on_each(nodes, _remove_probe, [(probe,)] * len(nodes), timeout_s, strict=False)


def _on_each(
    nodes: list[LiveNode], fn: Any, args: list[tuple[Any, ...]], timeout_s: float, strict: bool = True
) -> list[Any]:
    """``fn(*args[i])`` as a zero-CPU task pinned to ``nodes[i]`` (it runs even on a fully reserved cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote(*a)
        for n, a in zip(nodes, args)
    ]
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except ray.exceptions.GetTimeoutError:
        if not strict:
            return []
        raise ClusterError(
            f"cluster.storage_dir: the storage probe did not finish on every node within {timeout_s:g} s"
        ) from None


def _remove_probe(probe: str) -> None:
    import shutil

    shutil.rmtree(probe, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The run's session: what the driver wraps its stages in
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def session(cfg: Config, plan: PlacementPlan, run_dir: str | os.PathLike[str]) -> Iterator[Reservation]:
    """Connect, check `cluster.storage_dir` (when set) and reserve the plan; on exit release the group and,
    when this call connected, shut Ray down (a joined cluster keeps running: only this run's actors end)."""
    import ray

    owned = connect(cfg, run_dir)
    res: Reservation | None = None
    try:
        if cfg.cluster.storage_dir is not None:
            check_storage(cfg.cluster.storage_dir, cfg.cluster.connect_timeout_s)
        res = reserve(plan, cfg.cluster.reserve_timeout_s)
        yield res
    finally:
        if res is not None:
            res.release()
        if owned:
            ray.shutdown()
