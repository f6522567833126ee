"""Where every actor runs. One plan feeds both `dry_run=true` (printed) and the real Ray placement groups.

Placement is first-fit over nodes in a fixed order: rollout engines first (a tensor-parallel engine must
sit on one node), then replay actors, then learner ranks, then the driver. On a GPU cluster every actor
gets whole GPUs (engine: `rollout_tensor_parallel`, replay actor: 1, learner rank: 1) plus its CPU share;
on a CPU cluster (`gpus_per_node = 0`) the CPU shares are all there is and fractional shares are fine.

Invariants (tested): no GPU index is given twice on a node, no node's CPUs are oversubscribed, and every
requested actor is placed or the plan raises ConfigError naming the shortfall.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from draft_opd_ray.config.schema import ClusterConfig, Config
from draft_opd_ray.drafts import registry
from draft_opd_ray.errors import ConfigError

ROLLOUT, REPLAY, LEARNER, DRIVER = "rollout", "replay", "learner", "driver"


class Reservation(Protocol):
    """Ray actor options bound to the placement plan's bundle of ``(role, index)`` (`cluster.Reservation` is
    the real one)."""

    def options(self, role: str, index: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ActorSlot:
    role: str  # rollout | replay | learner | driver
    index: int  # rank within the role
    node: int
    gpus: tuple[int, ...]  # GPU indices on that node (empty on CPU clusters)
    cpus: float
    holds: str  # what the actor keeps in memory
    share: float = 1.0  # of each of its GPUs (< 1: it shares one GPU with other actors)

    @property
    def gpu_share(self) -> float:
        """The Ray GPU resource this actor asks for: whole GPUs, or its share of one."""
        return len(self.gpus) * self.share if self.gpus else 0.0


@dataclass
class PlacementPlan:
    cluster: str
    num_nodes: int
    gpus_per_node: int
    cpus_per_node: float
    slots: list[ActorSlot] = field(default_factory=list)
    vllm_layout: str = ""
    deepspeed_layout: str = ""

    def of(self, role: str) -> list[ActorSlot]:
        return [s for s in self.slots if s.role == role]

    def bundles(self, role: str | None = None) -> list[dict[str, float]]:
        """Ray placement-group bundles, one per actor in plan order: of ``role``, or of every actor but the
        driver (which runs outside the group)."""
        slots = [s for s in self.slots if (s.role == role if role else s.role != DRIVER)]
        return [{"CPU": s.cpus, **({"GPU": s.gpu_share} if s.gpus else {})} for s in slots]

    def gpus_used(self) -> int:
        return len({(s.node, g) for s in self.slots for g in s.gpus})

    def render(self) -> str:
        lines = [
            f"placement plan for cluster '{self.cluster}': {self.num_nodes} node(s) x "
            f"{self.gpus_per_node} GPU(s), {self.cpus_per_node:g} CPU(s) each",
            f"  {'role':<8} {'rank':>4} {'node':>4}  {'GPUs':<14} {'CPUs':>5}  holds",
        ]
        for s in self.slots:
            gpus = ",".join(map(str, s.gpus)) if s.gpus else "-"
            gpus += f" ({s.share:g})" if s.gpus and s.share < 1 else ""
            lines.append(f"  {s.role:<8} {s.index:>4} {s.node:>4}  {gpus:<14} {s.cpus:>5g}  {s.holds}")
        total_gpus = self.num_nodes * self.gpus_per_node
        lines.append(f"  vLLM:      {self.vllm_layout}")
        lines.append(f"  DeepSpeed: {self.deepspeed_layout}")
        lines.append(f"  GPUs used: {self.gpus_used()} of {total_gpus}; actors: {len(self.slots)}")
        return "\n".join(lines)


class _Node:
    def __init__(self, idx: int, gpus: int, cpus: float) -> None:
        self.idx, self.free, self.free_cpus = idx, [1.0] * gpus, cpus  # free share of each GPU

    @property
    def free_gpus(self) -> list[int]:
        return [g for g, f in enumerate(self.free) if f > 1 - 1e-9]

    def take(self, gpus: int, cpus: float, share: float = 1.0) -> tuple[int, ...] | None:
        """``gpus`` whole GPUs, or (``share`` < 1) that share of one GPU: the fullest one it still fits."""
        if self.free_cpus + 1e-9 < cpus:
            return None
        if share < 1 and gpus:
            fits = [g for g, f in enumerate(self.free) if f + 1e-9 >= share]
            if not fits:
                return None
            got: tuple[int, ...] = (min(fits, key=lambda g: (self.free[g], g)),)
            self.free[got[0]] -= share
        else:
            whole = self.free_gpus
            if len(whole) < gpus:
                return None
            got = tuple(whole[:gpus])
            for g in got:
                self.free[g] = 0.0
        self.free_cpus -= cpus
        return got


def plan_for(cfg: Config) -> PlacementPlan:
    """The run's plan: what `dry_run=true` prints, validation checks and the cluster reserves."""
    return build_plan(cfg.cluster, draft_kind=cfg.draft.kind, zero_stage=cfg.learner.zero_stage)


def build_plan(c: ClusterConfig, *, draft_kind: str, zero_stage: int) -> PlacementPlan:
    """The plan for cluster ``c`` (its shape and actor counts), or ConfigError naming what does not fit."""
    num_nodes, gpus_per_node, cpus_per_node = c.num_nodes, c.gpus_per_node, c.cpus_per_node
    rollout_engines, rollout_tensor_parallel = c.rollout_engines, c.rollout_tensor_parallel
    replay_actors, learner_ranks = c.replay_actors, c.learner_ranks
    gpu = gpus_per_node > 0
    if gpu and rollout_tensor_parallel > gpus_per_node:
        raise ConfigError(
            f"cluster.rollout_tensor_parallel: {rollout_tensor_parallel} GPUs per engine do not fit a node "
            f"of {gpus_per_node} GPUs"
        )
    need = (
        rollout_engines * rollout_tensor_parallel * c.gpus_per_rollout
        + replay_actors * c.gpus_per_replay
        + learner_ranks * c.gpus_per_learner
    )
    if gpu and need > num_nodes * gpus_per_node + 1e-9:
        raise ConfigError(
            f"cluster: the actors need {need:g} GPUs (rollout {rollout_engines}x{rollout_tensor_parallel}, "
            f"replay {replay_actors}, learner {learner_ranks}) but the cluster has "
            f"{num_nodes}x{gpus_per_node} = {num_nodes * gpus_per_node}"
        )
    nodes = [_Node(i, gpus_per_node, cpus_per_node) for i in range(num_nodes)]
    zero = f"ZeRO-{zero_stage} shard 1/{learner_ranks}" if zero_stage > 0 else "full replica"
    wants = (
        [
            (ROLLOUT, i, rollout_tensor_parallel, c.cpus_per_rollout, c.gpus_per_rollout)
            for i in range(rollout_engines)
        ]
        + [(REPLAY, i, 1, c.cpus_per_replay, c.gpus_per_replay) for i in range(replay_actors)]
        + [(LEARNER, i, 1, c.cpus_per_learner, c.gpus_per_learner) for i in range(learner_ranks)]
        + [(DRIVER, 0, 0, c.cpus_for_driver, 1.0)]
    )
    features = registry.draft_kind(draft_kind).feature_conditioned
    holds = {
        ROLLOUT: f"vLLM engine: target + {draft_kind} draft (TP {rollout_tensor_parallel if gpu else 1})",
        REPLAY: f"target (teacher log-probs{', features' if features else ''}) + draft copy",
        LEARNER: f"{draft_kind} draft (trainable) + AdamW state ({zero})",
        DRIVER: "queues, anchor selection, checkpoints, metrics",
    }
    plan = PlacementPlan(c.name, num_nodes, gpus_per_node, cpus_per_node)
    for role, idx, n_gpu, cpus, share in wants:
        n_gpu = n_gpu if gpu else 0
        for node in nodes:
            got = node.take(n_gpu, cpus, share)
            if got is not None:
                plan.slots.append(
                    ActorSlot(role, idx, node.idx, got, cpus, holds[role], share if got else 1.0)
                )
                break
        else:
            raise ConfigError(
                f"cluster: cannot place {role} #{idx} ({n_gpu} GPU(s), {cpus:g} CPU(s)); free per node: "
                + ", ".join(f"node {n.idx}: {len(n.free_gpus)} GPU / {n.free_cpus:g} CPU" for n in nodes)
                + f". Lower cluster.cpus_per_{role if role != DRIVER else 'driver'} or the actor counts."
            )
    device = "GPU" if gpu else "CPU"
    plan.vllm_layout = f"{rollout_engines} engine(s) x tensor_parallel_size={rollout_tensor_parallel if gpu else 1} on {device}"
    plan.deepspeed_layout = f"ZeRO stage {zero_stage}, data-parallel size {learner_ranks}, {device}"
    return plan
