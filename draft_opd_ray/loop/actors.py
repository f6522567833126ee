"""The Draft-OPD roles started in their bundles, and the driver's handles on the groups of them.

start_actors   every slot of the plan as a Ray actor in its own bundle: R rollout workers, M replay actors,
               L learner ranks (one DeepSpeed data-parallel group meeting at rank 0)
ReplayGroup    one step's sequences split over the M replay actors, balanced by the tokens each forward
               scores, and the teacher items (or references to them and their summaries) put back in order
LearnerGroup   one step on the L ranks: each mini-batch group split over the ranks (balanced by the student's
               block positions); the ranks sum the denominator first, so L ranks update exactly as one would
               on the whole group (tests/integration/test_scale_equivalence.py); rank 0 publishes and saves
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draft_opd_ray.config.schema import Config, DraftConfig, LearnerConfig, LossConfig, OptimConfig
from draft_opd_ray.distributed import balanced_shards
from draft_opd_ray.errors import RunError
from draft_opd_ray.placement import DRIVER, LEARNER, REPLAY, ROLLOUT, ActorSlot, PlacementPlan
from draft_opd_ray.waits import wait_for, when_back
from draft_opd_ray.wire import ReplayItem, TeacherItem, TeacherSummary, replay_cost

if TYPE_CHECKING:
    from draft_opd_ray.opd.learner import LearnerRun

Options = Callable[[str, int], dict[str, Any]]  # (role, rank) -> Ray actor options in that slot's bundle


class ReplayGroup:
    """The replay actors as one: `score` splits the sequences over them and returns the items in order. An actor
    that dies is restarted by Ray (``max_restarts`` each); ``on_restart(actor)`` restores its draft weights (a
    redrafting replay needs them) and its share is scored again: nothing is lost or scored twice."""

    def __init__(
        self, actors: Sequence[Any], max_restarts: int = 0, on_restart: Callable[[Any], None] | None = None
    ) -> None:
        self.actors = list(actors)
        self.last_shares = [0] * len(self.actors)  # sequences each actor scored in the last call
        self.max_restarts, self.on_restart = max_restarts, on_restart
        self.restarts = 0
        self._deaths = [0] * len(self.actors)

    def score(self, items: Sequence[ReplayItem]) -> list[TeacherItem]:
        """The teacher items themselves, fetched to the caller (tests, benchmarks; the loop uses `score_refs`)."""
        return self._score(items, split=False)

    def score_refs(self, items: Sequence[ReplayItem]) -> Scored:
        """Object references to the teacher items, and their summaries: the items stay on the replay actors'
        nodes until the learner ranks fetch them, so the driver neither receives nor re-puts the features."""
        got = self._score(items, split=True)
        return Scored([r for r, _ in got], [s for _, s in got])

    def _call(self, j: int, shard: Sequence[ReplayItem], split: bool) -> Any:
        if not split:
            return self.actors[j].score.remote(list(shard))
        # one return object per item (and the summaries first): each item is its own ref in the object store
        return self.actors[j].score_split.options(num_returns=len(shard) + 1).remote(list(shard))

    def _score(self, items: Sequence[ReplayItem], split: bool) -> list[Any]:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        shards = balanced_shards([replay_cost(it) for it in items], len(self.actors))
        self.last_shares = [len(s) for s in shards]
        todo = {j: self._call(j, [items[i] for i in s], split) for j, s in enumerate(shards) if s}
        out: list[Any] = [None] * len(items)
        while todo:
            j = next(iter(todo))
            ref = todo.pop(j)
            try:
                what = f"replay actor {j}: score {len(shards[j])} sequences"
                # split: the summaries only (small); the items' refs are ready once they are
                got = list(zip(ref[1:], wait_for(ref[0], what))) if split else wait_for(ref, what)
            except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
                self._deaths[j] += 1
                if self._deaths[j] > self.max_restarts:
                    raise RunError(
                        f"replay actor {j} died {self._deaths[j]} time(s) (cluster.max_restarts="
                        f"{self.max_restarts}): {str(e).strip().splitlines()[0]}; the last complete checkpoint "
                        "is kept: resume=<run dir> continues from it"
                    ) from None
                self.restarts += 1
                if self.on_restart is not None:
                    self.on_restart(self.actors[j])
                else:  # recorded replay holds no weights: only wait until Ray has it back
                    when_back(self.actors[j].scored_sequences.remote, f"restarted replay actor {j}")
                todo[j] = self._call(j, [items[i] for i in shards[j]], split)
                continue
            for i, t in zip(shards[j], got):
                out[i] = t
        assert all(t is not None for t in out)
        return out

    def scored_sequences(self) -> list[int]:

        return [
            int(n)
            for n in wait_for([a.scored_sequences.remote() for a in self.actors], "replay actors: counts")
        ]


@dataclass
class Scored:
    """One step's scored sequences as the driver holds them: object references to the `TeacherItem`s (in the
    items' order) and their `TeacherSummary`s."""

    refs: list[Any]
    summaries: list[TeacherSummary]


def merge_rank_rows(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from the ranks' rows: counts, FLOPs and the loss (each rank's share of the normalised
    objective) add up; the denominator (summed over the ranks already), lr and update count are rank 0's."""
    if all("skipped" in r for r in rows):
        nonfinite = {k: v for k, v in rows[0].items() if k == "nonfinite_updates"}  # the same on every rank
        return {"skipped": 1.0, **nonfinite}
    shared = (
        "denominator",
        "lr",
        "updates",
        "nonfinite_updates",
        "grad_norm",
        "clipped_updates",
    )  # same on all
    out = {k: v for k, v in rows[0].items() if k in shared}
    for r in rows:
        for k, v in r.items():
            if k not in shared:
                out[k] = out.get(k, 0.0) + v
    return out


class LearnerGroup:
    """The learner ranks as one: `step` shares every mini-batch group between them; rank 0 holds what is
    published and saved (all ranks hold the same weights after every update)."""

    def __init__(self, ranks: Sequence[Any]) -> None:
        self.ranks = list(ranks)
        self.rank0 = self.ranks[0]

    def shards(self, batch: Sequence[TeacherItem] | Scored, mini_batches: int) -> list[list[list[Any]]]:
        """[rank][group] -> that rank's sequences of that mini-batch group (the same groups on every rank): the
        items themselves, or for `Scored` their object references, split by the summaries' sizes."""
        from draft_opd_ray.opd.learner import split_by_anchors

        if isinstance(batch, Scored):
            items, sizes = list(batch.refs), list(batch.summaries)
        else:
            items, sizes = list(batch), [TeacherSummary.of(t) for t in batch]
        out: list[list[list[Any]]] = [[] for _ in self.ranks]
        for g in split_by_anchors([s.anchors for s in sizes], mini_batches):
            costs = [sizes[i].learner_cost for i in g]
            for r, s in enumerate(balanced_shards(costs, len(self.ranks))):
                out[r].append([items[g[i]] for i in s])
        return out

    def step(
        self, batch: Sequence[TeacherItem] | Scored, mini_batches: int, epochs: int = 1
    ) -> dict[str, float]:
        """One step on the ranks; with `Scored` each rank fetches its own items from the replay actors' nodes.
        ``epochs`` passes over the batch, each its ``mini_batches`` updates in the same order (`learner.epochs`)."""
        parts = [p * epochs for p in self.shards(batch, mini_batches)]
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            rows = wait_for(
                [r.step_shards.remote(p) for r, p in zip(self.ranks, parts)], "learner ranks: step"
            )
        except (RayActorError, ActorDiedError) as e:  # a data-parallel group does not re-form mid-run
            raise RunError(
                f"learner: a rank died during a step ({str(e).strip().splitlines()[0]}); the last complete "
                "checkpoint is kept: resume=<run dir> continues from it exactly"
            ) from None
        return merge_rank_rows(rows)

    def optimizer_states(self) -> list[dict[str, Any]]:

        return list(
            wait_for([r.optimizer_state.remote() for r in self.ranks], "learner ranks: optimizer state")
        )

    def load_optimizer_states(self, states: Sequence[dict[str, Any]]) -> None:
        """Each rank its own state (ZeRO shards differ); a checkpoint of another rank count is refused."""

        if len(states) != len(self.ranks):
            raise ValueError(
                f"the checkpoint holds {len(states)} learner rank state(s), the run has {len(self.ranks)}"
            )
        wait_for(
            [r.load_optimizer_state.remote(s) for r, s in zip(self.ranks, states)],
            "learner ranks: load optimizer",
        )


@dataclass
class Actors:
    workers: list[Any]
    replay: ReplayGroup
    learner: LearnerGroup
    world_size: int
    release: Callable[[], None]


def local_options(plan: PlacementPlan, timeout_s: float) -> tuple[Options, Callable[[], None]]:
    """A placement group on the running Ray with one bundle per slot in plan order (no node binding: for a
    single node, or when no reservation was made before the first stage)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from draft_opd_ray.errors import ConfigError

    slots = [s for s in plan.slots if s.role != DRIVER]
    pg = placement_group(plan.bundles(), strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ConfigError(
            f"cluster: the plan's {len(slots)} actors could not be placed within {timeout_s:g} s "
            f"(Ray has {ray.available_resources()})"
        )
    index = {(s.role, s.index): i for i, s in enumerate(slots)}

    def opts(role: str, rank: int) -> dict[str, Any]:
        s = slots[index[(role, rank)]]
        return {
            "num_cpus": s.cpus,
            "num_gpus": s.gpu_share,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index[(role, rank)]
            ),
        }

    return opts, lambda: remove_placement_group(pg)


def start_actors(
    cfg: Config,
    plan: PlacementPlan,
    target: str,
    draft_dir: str,
    total_updates: int,
    reservation: Any = None,
) -> Actors:
    """Every slot of the plan as an actor in its bundle: the reservation's (`draft_opd_ray.cluster`, bound to the
    plan's nodes), or a placement group made here."""
    if reservation is not None:
        opts: Options = reservation.options
        release: Callable[[], None] = lambda: None  # noqa: E731 - the caller releases its reservation
    else:
        opts, release = local_options(plan, cfg.cluster.reserve_timeout_s)
    cpu = cfg.cluster.gpus_per_node == 0
    workers = _rollout_workers(cfg, plan, target, draft_dir, opts, cpu)
    replay = ReplayGroup(
        [
            start_replay_actor(cfg, target, draft_dir, opts(REPLAY, s.index), cpu_share(cfg, plan, s))
            for s in plan.of(REPLAY)
        ],
        max_restarts=cfg.cluster.max_restarts,
    )
    ranks, world = _learner_ranks(cfg, plan, target, draft_dir, total_updates, opts, cpu)
    return Actors(workers, replay, LearnerGroup(ranks), world, release)


def _rollout_workers(
    cfg: Config, plan: PlacementPlan, target: str, draft_dir: str, opts: Options, cpu: bool
) -> list[Any]:
    import ray

    from draft_opd_ray.rollout.engine import EngineRun
    from draft_opd_ray.rollout.worker import RolloutWorker
    from draft_opd_ray.sync.nccl import plan_weight_sync

    ncores = os.cpu_count() or 1
    c = cfg.cluster
    nccl = plan_weight_sync(cfg.rollout.weight_sync, plan) == "nccl"
    topk, vocab, features = capture_settings(cfg, target, draft_dir)

    def run(s: ActorSlot) -> EngineRun:
        return EngineRun(
            target,
            cfg.draft.kind,
            draft_dir,
            seed=cfg.seed,
            cpu_bind=str(s.index % ncores) if cpu else None,
            tensor_parallel=len(s.gpus) or 1,
            weight_transfer="nccl" if nccl else None,
            capture_topk=topk,
            capture_vocab=vocab,
            capture_features=features,
        )

    return [
        ray.remote(RolloutWorker)
        .options(**opts(ROLLOUT, s.index), max_restarts=c.max_restarts)  # a killed engine comes back
        .remote(s.index, run(s), cfg.draft, cfg.target, cfg.rollout)  # target.dtype resolved on its node
        for s in plan.of(ROLLOUT)
    ]


def capture_settings(
    cfg: Config, target: str, draft_dir: str
) -> tuple[int | None, tuple[int, ...] | None, bool]:
    """(top-k, vocabulary as target ids, feature rows) the rollout engines capture the verification pass with where
    `teacher.source` resolves to verify (`opd.source`), else (None, None, False): no capture, the scheduler records.
    Feature rows where the kind's drafter is handed them (`DraftKind.features_from_drafter`: EAGLE-3; DFlash's are
    computed by the replay)."""
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.opd.source import teacher_source

    if not teacher_source(cfg.teacher, cfg.loss, cfg.replay).verify:
        return None, None, False
    kind = draft_kind(cfg.draft.kind)
    _, draft_ids = kind.replay_needs(draft_dir, target)
    vocab = tuple(draft_ids) if draft_ids is not None else None
    return cfg.teacher.topk, vocab, kind.features_from_drafter


def replay_holds_draft(cfg: Config) -> bool:
    """Whether the replay actors hold a copy of the current draft (a weight receiver): to redraft the blocks, or
    to find the draft's own top-m ids (`opd.replay.replay_draft_topm`)."""
    from draft_opd_ray.opd.replay import replay_draft_topm

    return cfg.replay.mode == "redraft" or replay_draft_topm(cfg.loss, cfg.teacher, cfg.replay) > 0


def cpu_share(cfg: Config, plan: PlacementPlan, slot: ActorSlot) -> tuple[int, int] | None:
    """(reserved cores, sharers) for a replay actor's or learner rank's torch threads on a CPU cluster
    (`cluster.cpu_threads`, `device.node_threads`); None: one thread (`one`) or not a CPU cluster.

    The replay runs while the engines generate the next rounds, so it keeps off the cores they are bound to
    (one each); the learner runs once they are mostly done (the next round is ready long before the replay
    ends) and takes every core. The actors of a role on one node work at once and split them."""
    if cfg.cluster.gpus_per_node > 0 or cfg.cluster.cpu_threads == "one":
        return None
    sharers = sum(s.node == slot.node for s in plan.of(slot.role))
    engines = sum(s.node == slot.node for s in plan.of(ROLLOUT)) if slot.role == REPLAY else 0
    return engines, sharers


def start_replay_actor(
    cfg: Config, target: str, draft_dir: str, options: dict[str, Any], share: tuple[int, int] | None
) -> Any:
    import ray

    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    feature_ids, draft_ids = draft_kind(cfg.draft.kind).replay_needs(draft_dir, target)
    threads = 1 if cfg.cluster.gpus_per_node == 0 else None
    run = ReplayRun(target, feature_ids, draft_ids, draft_dir, num_threads=threads, cpu_share=share)
    return (
        ray.remote(ReplayActor)
        .options(**options, max_restarts=cfg.cluster.max_restarts)
        .remote(run, cfg.draft, cfg.teacher, cfg.loss, cfg.replay)
    )


def _learner_ranks(
    cfg: Config,
    plan: PlacementPlan,
    target: str,
    draft_dir: str,
    total_updates: int,
    opts: Options,
    cpu: bool,
) -> tuple[list[Any], int]:
    from draft_opd_ray.opd.learner import LearnerRun

    slots = plan.of(LEARNER)
    n = len(slots)
    run = LearnerRun(draft_dir, target, total_updates, num_threads=1 if cpu else None)
    ranks = start_learner_ranks(
        n,
        lambda r: opts(LEARNER, r),
        run,
        (cfg.draft, cfg.loss, cfg.optim, cfg.learner),
        cpu_shares=[cpu_share(cfg, plan, s) for s in slots],
    )
    return ranks, n


def start_learner_ranks(
    n: int,
    options: Callable[[int], dict[str, Any]],
    run: LearnerRun,
    configs: tuple[DraftConfig, LossConfig, OptimConfig, LearnerConfig],
    cpu_shares: Sequence[tuple[int, int] | None] | None = None,
) -> list[Any]:
    """``n`` `Learner` actors forming one data-parallel group, each built from ``run`` (its rank, the group's size
    and meeting point, its CPU share filled in) and ``configs`` (`draft`, `loss`, `optim`, `learner`). A task in
    rank 0's bundle finds a free port on its node; every rank then joins there (DeepSpeed's process group forms
    once all ``n`` constructors run)."""
    import ray

    from draft_opd_ray.distributed import rendezvous_address
    from draft_opd_ray.opd.learner import Learner

    master = None
    if n > 1:
        where = {k: v for k, v in options(0).items() if k == "scheduling_strategy"}
        master = wait_for(
            ray.remote(rendezvous_address).options(num_cpus=0, **where).remote(),
            "learner rank 0: rendezvous port",
        )
    ranks = [
        ray.remote(Learner)
        .options(**options(r))
        .remote(
            dataclasses.replace(
                run, rank=r, world_size=n, master=master, cpu_share=cpu_shares[r] if cpu_shares else None
            ),
            *configs,
        )
        for r in range(n)
    ]
    sizes = wait_for([r.world_size.remote() for r in ranks], f"learner ranks: form a group of {n}")  # type: ignore[attr-defined]
    if set(sizes) != {n}:
        raise RuntimeError(f"learner ranks report world sizes {sizes}, expected {n}")
    return ranks
