"""The Draft-OPD loop: rollout workers → anchor selection → replay → learner → asynchronous weight broadcast.

Reads top to bottom:
    start actors in the placement group built from the plan (same plan as `dry_run=true`)
    keep one generation round in flight on every rollout worker
    for each step: take the next finished round, drop it if its draft is more than `max_staleness` versions
        behind the learner, write its records to anchors/, select anchors, replay them on the target, step
        the learner, publish the new weights (workers swap between rounds), log, checkpoint
The rollout workers never wait for the learner; the learner waits only for data, and each step takes every
round that has finished by then (one at least), so nothing generated is left to go stale.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.algo.anchors import select_anchors
from draft_opd_ray.checkpoint import clean_leftovers, latest_checkpoint, load_state, write_checkpoint
from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import RunError
from draft_opd_ray.flops import target_forward_flops
from draft_opd_ray.loop.actors import Actors, LearnerGroup, replay_holds_draft, start_actors
from draft_opd_ray.metrics import MetricsLogger
from draft_opd_ray.placement import PlacementPlan, plan_for
from draft_opd_ray.rollout.engine import Sampling
from draft_opd_ray.rollout.records import read_parquet, tau, write_parquet
from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync, WeightSync
from draft_opd_ray.waits import wait_for, when_back
from draft_opd_ray.wire import ReplayItem, RequestRecord, TeacherSummary

EMPTY_ROUNDS_LIMIT = 3  # rounds per worker in a row without one usable record before a step gives up


def committed_items(records: Sequence[RequestRecord], num_speculative_tokens: int) -> list[ReplayItem]:
    """`loss.objective=sft_on_rollouts`: every response position of every rollout as an anchor whose block is the
    committed continuation itself (all of it "accepted"), so the learner's cross-entropy is on committed tokens
    with the SFT arm's training-time-test states, and no drafted block is scored."""
    items = []
    for r in records:
        seq = r.prompt_ids + r.response_ids
        starts = range(len(r.prompt_ids) - 1, len(seq) - 1)  # the first response token is predicted too
        blocks = [seq[n + 1 : n + 1 + num_speculative_tokens] for n in starts]
        items.append(
            ReplayItem(seq, list(starts), blocks, [len(b) for b in blocks], max(0, min(r.policy_version)))
        )
    return items


def replay_items(records: Sequence[RequestRecord], cfg: Config, seed: int) -> list[ReplayItem]:
    if cfg.loss.objective != "opd":  # the controls: the committed continuations, no drafted block replayed
        return committed_items(records, cfg.draft.num_speculative_tokens)
    a = cfg.anchor
    anchors = select_anchors(
        records,
        policy=a.policy,
        max_per_sequence=a.max_per_sequence,
        max_per_step=a.max_per_step,
        seed=seed,
    )
    items = []
    redraft = cfg.replay.mode == "redraft"
    for q, group in itertools.groupby(anchors, key=lambda x: x.request):
        group_l = [g for g in group if g.drafted or redraft]  # random positions have no recorded block
        if not group_l:
            continue
        r = records[q]
        captured = None  # the verification pass's teacher at these steps (`teacher.source=verify`)
        if r.captured is not None and not redraft:
            captured = r.captured.select([g.step for g in group_l])
        items.append(
            ReplayItem(
                r.prompt_ids + r.response_ids,
                [g.pos for g in group_l],
                [list(g.drafted) for g in group_l],  # redraft replaces them
                [max(0, g.accepted) for g in group_l],
                max(0, group_l[0].policy_version),
                captured,
            )
        )
    return items


def make_weight_sync(
    cfg: Config,
    receivers: Sequence[Any],
    sender: Any = None,
    engines: Sequence[Any] | None = None,
    plan: PlacementPlan | None = None,
) -> WeightSync:
    """rollout.weight_sync (`sync.nccl.plan_weight_sync`): auto = NCCL from the learner's rank 0 (``sender``)
    into the vLLM ``engines`` on a GPU cluster where the sender has a GPU of its own in the placement ``plan``
    (default: the config's), else one shared-memory file per version on a single node, Ray's object store across
    nodes. Receivers: the rollout workers, and the replay actor when it holds a draft (`replay_holds_draft`)."""
    from draft_opd_ray.sync.nccl import NcclWeightSync, plan_weight_sync

    kind = plan_weight_sync(cfg.rollout.weight_sync, plan or plan_for(cfg))
    if kind == "nccl":
        if sender is None or engines is None:
            raise ValueError("the nccl weight sync needs the learner's rank 0 and the rollout engines")
        others = [r for r in receivers if r not in list(engines)]
        tp = [cfg.cluster.rollout_tensor_parallel] * len(engines)
        return NcclWeightSync(engines, sender, tp, others)
    return SharedFileWeightSync(receivers) if kind == "shm_file" else ObjectStoreWeightSync(receivers)


def rollout_target_flops(info: Any, r: RequestRecord, num_speculative_tokens: int) -> float:
    """Target verification work of one rollout: prefill + (K + 1) tokens per step (weights only, no attention)."""
    per_token = target_forward_flops(info, 1, 1)
    return per_token * (len(r.prompt_ids) + r.num_steps * (num_speculative_tokens + 1))


def save_checkpoint(
    run_dir: Path,
    step: int,
    learner: LearnerGroup,
    state: Any = None,
    flops: dict[str, float] | None = None,
    rounds: Any = None,
    elapsed_s: float = 0.0,
) -> Path:
    """checkpoints/opd/step_<n>/{draft/, training_state.pt, rounds/}, atomically (`draft_opd_ray.checkpoint`):
    rank 0's draft, every rank's optimizer state, the loop's counters and clock, and the pipeline: the feed's
    position and the finished rounds not yet taken (``rounds``: a drained `_Rounds`)."""
    import torch

    ready = list(rounds.ready) if rounds is not None else []

    def fill(tmp: Path) -> None:
        wait_for(
            learner.rank0.save.remote(str(tmp / "draft")), f"learner rank 0: save checkpoint step_{step}"
        )
        for j, got in enumerate(ready):
            # with their captured teacher: the resumed step trains on it as the uninterrupted one would
            write_parquet(got, tmp / "rounds" / f"round_{j:03d}.parquet", captured=True)
        saved = {
            "step": step,
            "version": state.version if state is not None else step,
            "dropped": state.dropped if state is not None else 0,
            "nonfinite_steps": state.nonfinite_steps if state is not None else 0,
            "rounds_submitted": rounds.submitted if rounds is not None else 0,
            "rounds_ready": len(ready),
            "elapsed_s": float(elapsed_s),
            "flops": dict(flops or {}),
            "ranks": learner.optimizer_states(),
        }
        torch.save(saved, tmp / "training_state.pt")

    return write_checkpoint(run_dir / "checkpoints" / "opd", f"step_{step}", fill)


def take_rounds(
    finished: Sequence[list[RequestRecord]], version: int, max_staleness: int
) -> tuple[list[RequestRecord], int, int]:
    """The records of the finished rounds whose oldest block is at most ``max_staleness`` versions behind the
    learner's ``version`` (failed or empty requests left out). Returns (records, rounds dropped as stale, the
    largest lag kept)."""
    records: list[RequestRecord] = []
    dropped = behind = 0
    for got in finished:
        got = [r for r in got if not r.error and r.num_steps]
        lag = version - min((min(r.policy_version) for r in got), default=version)
        if lag > max_staleness:
            dropped += 1
            continue
        records += got
        behind = max(behind, lag)
    return records, dropped, behind


class _Rounds:
    """One generation round in flight on every rollout worker; a round is replaced by the next prompts of the feed
    as soon as it is collected, so the workers keep generating while the learner steps. A step trains on the next
    ``opd.rounds_per_step`` rounds in feed order (`take`, oldest first), so its batch does not depend on timing.

    ``submitted``: rounds handed out so far (the feed's position: round i starts at prompt ``i * per_round`` of the
    cycled prompt list). ``ready``: finished rounds not taken yet: a checkpoint `drain`s the workers and keeps
    their rounds, and a resumed run starts with those, so it sees the same rounds in the same order.

    A worker that dies is restarted by Ray (`cluster.max_restarts`); ``on_restart(worker)`` gives it the current
    weights, and its lost round is generated again from the same prompts: no prompt's records are lost or taken
    twice. ``restarts`` counts them."""

    def __init__(
        self,
        workers: Sequence[Any],
        prompts: Sequence[list[int]],
        per_round: int,
        sampling: Sampling,
        submitted: int = 0,
        ready: Sequence[list[RequestRecord]] = (),
        on_restart: Callable[[Any], None] | None = None,
        max_restarts: int = 0,
    ):
        self.prompts, self.n, self.sampling = prompts, per_round, sampling
        self.starts = range(0, max(1, len(prompts)), per_round)
        self.submitted = submitted
        self.ready = list(ready)
        self.workers = list(workers)
        self.on_restart, self.max_restarts = on_restart, max_restarts
        self.restarts = 0
        self._deaths = [0] * len(self.workers)
        # ref -> (worker index, first prompt of its round, the round's number in the feed)
        self.inflight: dict[Any, tuple[int, int, int]] = {}
        self.refill()

    def refill(self) -> None:
        """A round in flight on every worker that has none (all of them after `drain`)."""
        busy = {w for w, _, _ in self.inflight.values()}
        for w in range(len(self.workers)):
            if w not in busy:
                self._submit(w)

    def _submit(self, w: int, again: tuple[int, int] | None = None) -> None:
        """The feed's next round on worker ``w``, or ``again`` = (first prompt, number) of a round it lost."""
        if again is None:
            again = (self.starts[self.submitted % len(self.starts)], self.submitted)
            self.submitted += 1
        start, number = again
        ref = self.workers[w].generate.remote(list(self.prompts[start : start + self.n]), self.sampling)
        self.inflight[ref] = (w, start, number)

    def _oldest(self) -> Any:
        """The round in flight that was handed out first (a lost round keeps its number when handed out again)."""
        return min(self.inflight, key=lambda r: self.inflight[r][2])

    def _collect(self, ref: Any, what: str) -> list[RequestRecord] | None:
        """The round behind ``ref``, or None when its worker died (then restarted, given the current weights and
        the same prompts again)."""
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        w, start, number = self.inflight.pop(ref)
        try:
            return wait_for(ref, what)  # type: ignore[no-any-return]
        except (RayActorError, ActorDiedError, ActorUnavailableError) as e:
            self._deaths[w] += 1
            if self._deaths[w] > self.max_restarts or self.on_restart is None:
                raise RunError(
                    f"rollout worker {w} died {self._deaths[w]} time(s) (cluster.max_restarts="
                    f"{self.max_restarts}): {str(e).strip().splitlines()[0]}; the last complete checkpoint is "
                    "kept: resume=<run dir> continues from it"
                ) from None
            self.restarts += 1
            self.on_restart(self.workers[w])
            self._submit(w, (start, number))
            return None

    def drain(self) -> list[list[RequestRecord]]:
        """Wait for every round in flight (in the order they were handed out) and keep them for the next `take`;
        the workers stay idle until `refill`. Returns every round not taken yet."""
        while self.inflight:
            ref = self._oldest()
            got = self._collect(ref, "rollout worker: finish its round for the checkpoint")
            if got is not None:
                self.ready.append(got)
        return list(self.ready)

    def take(self, k: int) -> list[list[RequestRecord]]:
        """The next ``k`` rounds in the order they were handed out (the rounds kept by `drain` first); each
        collected round's worker gets the next prompts at once. A step's batch is the same whichever worker
        finishes first, and a checkpoint's drain does not change it."""
        out, self.ready = self.ready[:k], self.ready[k:]
        while len(out) < k:
            ref = self._oldest()
            w = self.inflight[ref][0]
            got = self._collect(ref, f"rollout worker {w}: generate ({len(self.inflight)} rounds in flight)")
            if got is not None:
                out.append(got)
                self._submit(w)  # keep it busy
        return out


def _resume_point(cfg: Config, run_dir: Path) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to continue from (`resume=<run dir>`) and its training state, or (None, {})."""
    root = run_dir / "checkpoints" / "opd"
    clean_leftovers(root)
    last = latest_checkpoint(root, "training_state.pt") if cfg.resume else None
    if last is None:
        return None, {}
    return last, load_state(last / "training_state.pt")


def _saved_rounds(last: Path | None, saved: dict[str, Any]) -> list[list[RequestRecord]]:
    """The finished rounds a checkpoint kept, in order."""
    n = int(saved.get("rounds_ready", 0))
    return [read_parquet(last / "rounds" / f"round_{j:03d}.parquet") for j in range(n)] if last else []


def run_opd(
    cfg: Config,
    plan: PlacementPlan,
    target: str,
    draft_dir: str,
    prompts: Sequence[list[int]],
    stop_token_ids: Sequence[int],
    run_dir: Path,
    metrics: MetricsLogger,
    reservation: Any = None,
) -> Path:
    """The loop; ``reservation`` (`draft_opd_ray.cluster`): the bundles reserved for the plan before the first
    stage (None: a placement group is made here on the running Ray). Rollouts stop at any of ``stop_token_ids``
    (the target's eos ids: `models.target.stop_token_ids`)."""
    from tqdm import tqdm

    from draft_opd_ray.models.target import read_target_info

    info = read_target_info(target)
    flops = {"flops_draft": 0.0, "flops_target": 0.0, "flops_rollout": 0.0}
    resume, saved = _resume_point(cfg, run_dir)
    start_step = int(saved.get("step", 0))
    flops.update(saved.get("flops", {}))
    last = str(resume / "draft") if resume else draft_dir
    total_updates = cfg.opd.steps * cfg.learner.mini_batches * cfg.learner.epochs
    actors = start_actors(cfg, plan, target, last, total_updates, reservation=reservation)
    sync: WeightSync | None = None
    try:
        sync = _resume_actors(cfg, actors, saved, start_step, plan)
        sampling = Sampling(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=cfg.seed,
            stop_token_ids=tuple(stop_token_ids),
        )
        state = _LoopState(
            version=int(saved.get("version", start_step)),
            dropped=int(saved.get("dropped", 0)),
            nonfinite_steps=int(saved.get("nonfinite_steps", 0)),
        )
        rounds = _Rounds(
            actors.workers,
            prompts,
            cfg.rollout.prompts_per_round,
            sampling,
            submitted=int(saved.get("rounds_submitted", 0)),
            ready=_saved_rounds(resume, saved),
            on_restart=lambda w: _restart_worker(actors, sync, w, state.version),
            max_restarts=cfg.cluster.max_restarts,
        )
        if replay_holds_draft(cfg):  # a restarted replay actor redrafts (or ranks) with the current weights
            actors.replay.on_restart = lambda a: _restore_receiver(actors, a, state.version, "replay actor")
        if resume is not None:
            metrics.resume("opd", start_step)
        bar = tqdm(
            range(start_step, cfg.opd.steps), desc="draft-opd", initial=start_step, total=cfg.opd.steps
        )
        for step in bar:
            row = _one_step(cfg, actors, rounds, sync, state, step, info, flops, run_dir, metrics)
            if row is None:
                continue  # nothing applied (no anchors, or a non-finite loss): nothing published or saved
            bar.set_postfix(loss=f"{row.get('loss', float('nan')):.3f}", tau=f"{row['tau']:.2f}")
            if (step + 1) % cfg.opd.checkpoint_every == 0 or step + 1 == cfg.opd.steps:
                rounds.drain()  # the rounds in flight belong to the checkpoint: a resume starts with them
                saved_at = save_checkpoint(
                    run_dir, step + 1, actors.learner, state, flops, rounds, metrics.elapsed()
                )
                last = str(saved_at / "draft")
                rounds.refill()
        sync.close()
        _shutdown(actors.workers)
    finally:
        if sync is not None:
            sync.close(wait=False)  # after a failure too: frees the shared-memory slots
        actors.release()
    plot_tau(run_dir)
    return Path(last)


@dataclasses.dataclass
class _LoopState:
    version: int  # the learner's published weight version
    dropped: int = 0  # rounds dropped as stale so far
    nonfinite_run: int = 0  # steps in a row whose every update had a non-finite loss or gradient
    nonfinite_steps: int = 0  # such steps so far


def _restore_receiver(actors: Actors, receiver: Any, version: int, role: str) -> None:
    """A restarted rollout worker (or redrafting replay actor) gets the weights the learner published last, once
    Ray has it back."""
    weights = wait_for(
        actors.learner.rank0.rollout_state.remote(), f"learner rank 0: weights for a restarted {role}"
    )
    when_back(lambda: receiver.load_draft_weights.remote(weights, version), f"restarted {role}: load weights")


def _restart_worker(actors: Actors, sync: WeightSync | None, worker: Any, version: int) -> None:
    """A restarted rollout worker: the weight sync learns of it first (NCCL re-forms its group before the next
    publication, or raises when a broadcast can no longer complete), then it gets the current weights."""
    if sync is not None:
        sync.restarted(worker)
    _restore_receiver(actors, worker, version, "rollout worker")


def _resume_actors(
    cfg: Config, actors: Actors, saved: dict[str, Any], start_step: int, plan: PlacementPlan | None = None
) -> WeightSync:
    """Restore a resumed run's optimizer states and versions; the weight sync to the receivers."""

    redraft = replay_holds_draft(cfg)  # the replay's draft copy is a weight receiver too
    if saved:
        actors.learner.load_optimizer_states(saved.get("ranks", [saved]))
        # the workers start with the checkpoint's weights: that is version start_step, not 0 (else every
        # round would look start_step versions stale and be dropped)
        wait_for([w.set_version.remote(start_step) for w in actors.workers], "rollout workers: set version")
        if redraft:
            wait_for(
                [a.set_draft_version.remote(start_step) for a in actors.replay.actors], "replay: set version"
            )
    receivers = [*actors.workers, *actors.replay.actors] if redraft else actors.workers
    sync = make_weight_sync(cfg, receivers, sender=actors.learner.rank0, engines=actors.workers, plan=plan)
    sync.version = int(saved.get("version", start_step))
    return sync


def _take_records(
    cfg: Config, actors: Actors, rounds: _Rounds, state: _LoopState
) -> tuple[list[RequestRecord], int]:
    """The records of the rounds taken for a step (waiting until one has a usable record; stale rounds dropped
    and counted), and how many versions behind the oldest kept block is."""
    records: list[RequestRecord] = []
    behind = 0
    empty = 0
    while not records:
        got = rounds.take(cfg.opd.rounds_per_step or len(actors.workers))
        records, d, behind = take_rounds(got, state.version, cfg.async_.max_staleness)
        state.dropped += d
        empty += 0 if records or d else len(got)
        if empty >= EMPTY_ROUNDS_LIMIT * len(actors.workers):
            raise RunError(
                f"opd: {empty} rollout rounds in a row gave no usable record (no speculative step: every "
                f"request failed or ended before the first verification, rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens}); raise rollout.max_new_tokens or check the rollout workers' log"
            )
    return records, behind


def _add_flops(
    flops: dict[str, float],
    learner_draft: float,
    summaries: Sequence[TeacherSummary],
    records: Sequence[RequestRecord],
    info: Any,
    cfg: Config,
) -> None:
    """A step's training compute added to the run's totals: the draft's (the learner's forward + backward, and the
    replay's draft forward where it finds the draft's own top-m), the replay's target forwards, the rollouts'."""
    flops["flops_draft"] += learner_draft + sum(t.draft_flops for t in summaries)
    flops["flops_target"] += sum(
        target_forward_flops(info, 1, t.scored_tokens) for t in summaries if t.target_ran
    )
    flops["flops_rollout"] += sum(
        rollout_target_flops(info, r, cfg.draft.num_speculative_tokens) for r in records
    )


def _one_step(
    cfg: Config,
    actors: Actors,
    rounds: _Rounds,
    sync: WeightSync,
    state: _LoopState,
    step: int,
    info: Any,
    flops: dict[str, float],
    run_dir: Path,
    metrics: MetricsLogger,
) -> dict[str, Any] | None:
    """Take rounds, write their records, replay the anchors, step the learner ranks, publish, log the row."""

    t0 = time.time()
    records, behind = _take_records(cfg, actors, rounds, state)
    t_roll = time.time() - t0
    write_parquet(records, run_dir / "anchors" / f"step_{step:05d}.parquet")
    items = replay_items(records, cfg, seed=cfg.anchor.seed + step)
    if not items:
        metrics.log("opd", step + 1, tau=tau(records), skipped="no anchors")
        return None
    t1 = time.time()
    # the teacher items go from the replay actors' nodes to the learner ranks' as object references; the
    # driver reads only their summaries (sizes for the sharding, counts for the metrics)
    scored = actors.replay.score_refs(items)
    t2 = time.time()
    out = actors.learner.step(scored, cfg.learner.mini_batches, cfg.learner.epochs)
    t3 = time.time()
    if "skipped" in out:
        _count_nonfinite(cfg, state, out, step, run_dir)
        metrics.log(
            "opd",
            step + 1,
            tau=tau(records),
            skipped="non-finite" if out.get("nonfinite_updates") else "empty",
            nonfinite_steps=state.nonfinite_steps,
            policy_version=state.version,
        )
        return None
    state.nonfinite_run = 0
    summaries = scored.summaries
    _add_flops(flops, float(out.pop("flops_draft_step", 0.0)), summaries, records, info, cfg)
    state.version += 1
    weights = wait_for(
        actors.learner.rank0.rollout_state.remote(), f"learner rank 0: weights of step {step + 1}"
    )
    sync.publish(state.version, weights)
    shares = {f"replay{i}_seqs": float(n) for i, n in enumerate(actors.replay.last_shares)}
    return metrics.log(
        "opd",
        step + 1,
        **out,
        tau=tau(records),
        policy_version=state.version,
        staleness=behind,
        dropped_stale=state.dropped,
        rollout_wait_s=round(t_roll, 2),
        replay_s=round(t2 - t1, 2),
        learner_s=round(t3 - t2, 2),
        publish_s=round(time.time() - t3, 2),
        step_s=round(time.time() - t0, 2),
        replay_accept_agree=sum(t.agree for t in summaries) / max(1, sum(t.anchors for t in summaries)),
        replay_payload_mb=round(sum(t.payload_bytes for t in summaries) / 2**20, 3),
        # sequences whose teacher came from the verification pass (`teacher.source=verify`), not a replay forward
        teacher_captured=sum(it.captured is not None for it in items) / len(items),
        learner_world_size=actors.world_size,
        records=len(records),
        rollout_restarts=rounds.restarts,
        replay_restarts=actors.replay.restarts,
        nonfinite_steps=state.nonfinite_steps,
        **shares,
        **flops,
    )


def _count_nonfinite(cfg: Config, state: _LoopState, out: dict[str, float], step: int, run_dir: Path) -> None:
    """Count a step that applied nothing because of a non-finite loss or gradient; `opd.max_nonfinite_steps` of
    them in a row stop the run (its last checkpoint holds the last good weights)."""
    if not out.get("nonfinite_updates"):
        return
    state.nonfinite_run += 1
    state.nonfinite_steps += 1
    if state.nonfinite_run >= cfg.opd.max_nonfinite_steps:
        last = latest_checkpoint(run_dir / "checkpoints" / "opd", "training_state.pt")
        raise RunError(
            f"opd: {state.nonfinite_run} steps in a row (to step {step + 1}) had a non-finite loss or gradient "
            f"and applied nothing (opd.max_nonfinite_steps={cfg.opd.max_nonfinite_steps}); the last good "
            f"weights: {last / 'draft' if last else 'the starting draft (no checkpoint yet)'}"
        )


def _shutdown(workers: Sequence[Any]) -> None:

    wait_for([w.shutdown.remote() for w in workers], "rollout workers: shut down")


def plot_tau(run_dir: Path) -> None:
    """opd_tau.png: τ of each rollout round (the draft's own acceptance on training prompts) over learner
    steps, with a running mean, and the loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from draft_opd_ray.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["stage"] == "opd" and "loss" in r]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    taus = [r["tau"] for r in rows]
    w = max(1, len(rows) // 8)
    smooth = [
        sum(taus[max(0, i - w + 1) : i + 1]) / len(taus[max(0, i - w + 1) : i + 1]) for i in range(len(taus))
    ]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3))
    a1.plot(steps, taus, ".", alpha=0.5, label="rollout round")
    a1.plot(steps, smooth, "-", label=f"running mean ({w})")
    a1.set_xlabel("learner step")
    a1.set_ylabel("τ on training rollouts")
    a1.set_title("τ of the rollouts it trains on (not held out)", fontsize=9)
    a1.legend()
    a2.plot(steps, [r["loss"] for r in rows])
    a2.set_xlabel("learner step")
    a2.set_ylabel("Draft-OPD loss")
    a2.set_title("training loss", fontsize=9)
    fig.tight_layout()
    fig.savefig(run_dir / "opd_tau.png", dpi=100)
    plt.close(fig)
