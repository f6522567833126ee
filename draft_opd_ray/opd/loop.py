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
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.algo.anchors import select_anchors
from draft_opd_ray.algo.loss import LossSpec
from draft_opd_ray.checkpoint import latest_checkpoint, write_checkpoint
from draft_opd_ray.config.schema import Config, LossConfig
from draft_opd_ray.device import resolve_dtype
from draft_opd_ray.flops import target_forward_flops
from draft_opd_ray.metrics import MetricsLogger
from draft_opd_ray.opd.batch import ReplayItem
from draft_opd_ray.opd.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync, WeightSync
from draft_opd_ray.placement import DRIVER, LEARNER, REPLAY, ROLLOUT, PlacementPlan
from draft_opd_ray.rollout.engine import Sampling
from draft_opd_ray.rollout.records import RequestRecord, tau, write_parquet


def loss_spec(c: LossConfig) -> LossSpec:
    """The objective's settings: the fields LossSpec shares with `loss.*`, and the clamp."""
    same = {f.name: getattr(c, f.name) for f in dataclasses.fields(LossSpec) if hasattr(c, f.name)}
    return LossSpec(**same, clamp=c.logprob_clamp)


def start_actors(
    cfg: Config, plan: PlacementPlan, target: str, draft_dir: str, total_steps: int
) -> dict[str, Any]:
    """Placement group with one bundle per actor (in plan order), then the actors in their bundles."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from draft_opd_ray.opd.learner import Learner
    from draft_opd_ray.opd.replay import ReplayActor
    from draft_opd_ray.opd.students import replay_needs
    from draft_opd_ray.rollout.worker import RolloutWorker

    slots = [s for s in plan.slots if s.role != DRIVER]
    bundles = [{"CPU": s.cpus, **({"GPU": float(len(s.gpus))} if s.gpus else {})} for s in slots]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready())
    index = {(s.role, s.index): i for i, s in enumerate(slots)}

    def opts(role: str, rank: int) -> dict[str, Any]:
        s = slots[index[(role, rank)]]
        return {
            "num_cpus": s.cpus,
            "num_gpus": len(s.gpus),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index[(role, rank)]
            ),
        }

    cpu = cfg.cluster.gpus_per_node == 0
    ncores = os.cpu_count() or 1
    workers = [
        ray.remote(RolloutWorker)
        .options(**opts(ROLLOUT, s.index))
        .remote(
            s.index,
            target,
            draft_kind=cfg.draft.kind,
            draft_path=draft_dir,
            num_speculative_tokens=cfg.draft.num_speculative_tokens,
            max_model_len=cfg.target.max_model_len,
            dtype=cfg.target.dtype,
            kvcache_gb=cfg.rollout.kvcache_gb,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            cpu_bind=str(s.index % ncores) if cpu else None,
            seed=cfg.seed,
        )
        for s in plan.of(ROLLOUT)
    ]
    feature_ids, draft_ids = replay_needs(cfg.draft.kind, draft_dir, target)
    replay = (
        ray.remote(ReplayActor)
        .options(**opts(REPLAY, 0))
        .remote(
            target,
            aux_layer_ids=feature_ids,
            draft_ids=draft_ids,
            k=cfg.draft.num_speculative_tokens,
            dtype=resolve_dtype(cfg.teacher.dtype),
            num_threads=1 if cpu else None,
            payload="topk" if cfg.teacher.topk is not None else "full",
            topk=cfg.teacher.topk or 1,
            teacher=cfg.loss.objective == "opd",
            mode=cfg.replay.mode,
            draft_kind=cfg.draft.kind,
            draft_dir=draft_dir,
        )
    )
    o = cfg.optim
    learner = (
        ray.remote(Learner)
        .options(**opts(LEARNER, 0))
        .remote(
            draft_dir,
            target,
            kind=cfg.draft.kind,
            spec=loss_spec(cfg.loss),
            objective=cfg.loss.objective,
            lr=o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
            warmup_ratio=o.warmup_ratio,
            schedule=o.schedule,
            total_steps=total_steps,
            zero_stage=cfg.learner.zero_stage,
            grad_clip=o.grad_clip,
            dtype=resolve_dtype(cfg.learner.dtype),
            train_lm_head=cfg.draft.train_lm_head,
            num_threads=1 if cpu else None,
            backend=cfg.learner.backend,
        )
    )
    return {"workers": workers, "replay": replay, "learner": learner, "pg": pg}


def committed_items(records: Sequence[RequestRecord], k: int) -> list[ReplayItem]:
    """`loss.objective=sft_on_rollouts`: every response position of every rollout as an anchor whose block is the
    committed continuation itself (all of it "accepted"), so the learner's cross-entropy is on committed tokens
    with the SFT arm's training-time-test states, and no drafted block is scored."""
    items = []
    for r in records:
        seq = r.prompt_ids + r.response_ids
        starts = range(len(r.prompt_ids) - 1, len(seq) - 1)  # the first response token is predicted too
        blocks = [seq[n + 1 : n + 1 + k] for n in starts]
        items.append(
            ReplayItem(seq, list(starts), blocks, [len(b) for b in blocks], max(0, min(r.policy_version)))
        )
    return items


def replay_items(records: Sequence[RequestRecord], cfg: Config, seed: int) -> list[ReplayItem]:
    if cfg.loss.objective == "sft_on_rollouts":
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
        items.append(
            ReplayItem(
                r.prompt_ids + r.response_ids,
                [g.pos for g in group_l],
                [list(g.drafted) for g in group_l],  # redraft replaces them
                [max(0, g.accepted) for g in group_l],
                max(0, group_l[0].policy_version),
            )
        )
    return items


def make_weight_sync(cfg: Config, receivers: Sequence[Any]) -> WeightSync:
    """rollout.weight_sync: auto = one shared-memory file per version on a single node, Ray's object store
    across nodes. Receivers: the rollout workers, and the replay actor when it redrafts."""
    kind = cfg.rollout.weight_sync
    if kind == "auto":
        kind = "shm_file" if cfg.cluster.num_nodes == 1 else "object_store"
    return SharedFileWeightSync(receivers) if kind == "shm_file" else ObjectStoreWeightSync(receivers)


def scored_tokens(t: Any) -> int:
    """Tokens the replay forward scored for one sequence: the sequence plus every anchor's branch."""
    branch = (t.valid_len - t.accepted - 1).clamp(min=0)
    return int(len(t.input_ids) + branch.sum())


def rollout_target_flops(info: Any, r: RequestRecord, k: int) -> float:
    """Target verification work of one rollout: prefill + (K + 1) tokens per step (weights only, no attention)."""
    per_token = target_forward_flops(info, 1, 1)
    return per_token * (len(r.prompt_ids) + r.num_steps * (k + 1))


def save_checkpoint(run_dir: Path, step: int, learner: Any, flops: dict[str, float] | None = None) -> Path:
    """checkpoints/opd/step_<n>/{draft/, training_state.pt}, atomically (`draft_opd_ray.checkpoint`)."""
    import ray
    import torch

    def fill(tmp: Path) -> None:
        ray.get(learner.save.remote(str(tmp / "draft")))
        state = {"step": step, "flops": dict(flops or {}), **ray.get(learner.optimizer_state.remote())}
        torch.save(state, tmp / "training_state.pt")

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
    """One generation round in flight on every rollout worker; a finished round is replaced at once by the next
    prompts of the feed, so the workers never wait for the learner."""

    def __init__(
        self, workers: Sequence[Any], prompts: Sequence[list[int]], per_round: int, sampling: Sampling
    ):
        self.prompts, self.n, self.sampling = prompts, per_round, sampling
        self.feed = itertools.cycle(range(0, max(1, len(prompts)), per_round))
        self.inflight = {self._submit(w): w for w in workers}

    def _submit(self, worker: Any) -> Any:
        i = next(self.feed)
        return worker.generate.remote(list(self.prompts[i : i + self.n]), self.sampling)

    def take(self) -> list[list[RequestRecord]]:
        """Wait for one round, then take every other round that has finished too."""
        import ray

        ready, _ = ray.wait(list(self.inflight), num_returns=1)
        rest = [r for r in self.inflight if r != ready[0]]
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        out = []
        for ref in ready + more:
            worker = self.inflight.pop(ref)
            out.append(ray.get(ref))
            self.inflight[self._submit(worker)] = worker  # keep it busy
        return out


def _resume_point(cfg: Config, run_dir: Path) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to continue from (`resume=true`) and its training state, or (None, {})."""
    import torch

    last = latest_checkpoint(run_dir / "checkpoints" / "opd", "training_state.pt") if cfg.resume else None
    if last is None:
        return None, {}
    return last, torch.load(last / "training_state.pt", weights_only=False)


def run_opd(
    cfg: Config,
    plan: PlacementPlan,
    target: str,
    draft_dir: str,
    prompts: Sequence[list[int]],
    eos_token_id: int | None,
    run_dir: Path,
    metrics: MetricsLogger,
) -> Path:
    import ray
    from tqdm import tqdm

    from draft_opd_ray.models.target import read_target_info

    info = read_target_info(target)
    flops = {"flops_draft": 0.0, "flops_target": 0.0, "flops_rollout": 0.0}
    resume, saved = _resume_point(cfg, run_dir)
    start_step = int(saved.get("step", 0))
    flops.update(saved.get("flops", {}))
    actors = start_actors(
        cfg,
        plan,
        target,
        str(resume / "draft") if resume else draft_dir,
        cfg.opd.steps * cfg.learner.mini_batches,
    )
    workers, replay, learner = actors["workers"], actors["replay"], actors["learner"]
    if resume is not None:
        ray.get(learner.load_optimizer_state.remote(saved))
        # the workers start with the checkpoint's weights: that is version start_step, not 0 (else every
        # round would look start_step versions stale and be dropped)
        ray.get([w.set_version.remote(start_step) for w in workers])
        if cfg.replay.mode == "redraft":
            ray.get(replay.set_draft_version.remote(start_step))
    sync = make_weight_sync(cfg, [*workers, replay] if cfg.replay.mode == "redraft" else workers)
    sync.version = start_step
    sampling = Sampling(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.seed,
        stop_token_ids=(eos_token_id,) if eos_token_id is not None else (),
    )
    rounds = _Rounds(workers, prompts, cfg.rollout.prompts_per_round, sampling)
    version, dropped, last = start_step, 0, str(resume / "draft") if resume else draft_dir
    bar = tqdm(range(start_step, cfg.opd.steps), desc="draft-opd", initial=start_step, total=cfg.opd.steps)
    for step in bar:
        t0 = time.time()
        records: list[RequestRecord] = []
        behind = 0
        while not records:
            records, d, behind = take_rounds(rounds.take(), version, cfg.async_.max_staleness)
            dropped += d
        t_roll = time.time() - t0
        write_parquet(records, run_dir / "anchors" / f"step_{step:05d}.parquet")
        items = replay_items(records, cfg, seed=cfg.anchor.seed + step)
        if not items:
            metrics.log("opd", step + 1, tau=tau(records), skipped="no anchors")
            continue
        t1 = time.time()
        teacher = ray.get(replay.score.remote(items))
        t2 = time.time()
        out = ray.get(learner.step.remote(teacher, cfg.learner.mini_batches))
        t3 = time.time()
        flops["flops_draft"] += float(out.pop("flops_draft_step", 0.0))
        flops["flops_target"] += sum(
            target_forward_flops(info, 1, scored_tokens(t)) for t in teacher if _target_ran(t)
        )
        flops["flops_rollout"] += sum(
            rollout_target_flops(info, r, cfg.draft.num_speculative_tokens) for r in records
        )
        version += 1
        sync.publish(version, ray.get(learner.rollout_state.remote()))
        row = metrics.log(
            "opd",
            step + 1,
            **out,
            tau=tau(records),
            policy_version=version,
            staleness=behind,
            dropped_stale=dropped,
            rollout_wait_s=round(t_roll, 2),
            replay_s=round(t2 - t1, 2),
            learner_s=round(t3 - t2, 2),
            publish_s=round(time.time() - t3, 2),
            step_s=round(time.time() - t0, 2),
            replay_accept_agree=_agreement(teacher),
            **flops,
        )
        bar.set_postfix(loss=f"{out.get('loss', float('nan')):.3f}", tau=f"{row['tau']:.2f}")
        if (step + 1) % cfg.opd.checkpoint_every == 0 or step + 1 == cfg.opd.steps:
            last = str(save_checkpoint(run_dir, step + 1, learner, flops) / "draft")
    sync.close()
    for w in workers:
        ray.get(w.shutdown.remote())
    plot_tau(run_dir)
    return Path(last)


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
    a1.set_ylabel("τ (rollouts)")
    a1.legend()
    a2.plot(steps, [r["loss"] for r in rows])
    a2.set_xlabel("learner step")
    a2.set_ylabel("Draft-OPD loss")
    fig.tight_layout()
    fig.savefig(run_dir / "opd_tau.png", dpi=100)
    plt.close(fig)


def _target_ran(t: Any) -> bool:
    """Whether the replay ran the target for this sequence (not for a standalone draft's sft_on_rollouts)."""
    return t.teacher_logprobs is not None or t.teacher_topk_ids is not None or t.features.numel() > 0


def _agreement(teacher: Sequence[Any]) -> float:
    """Share of anchors whose greedy acceptance under replay equals the recorded one (HF vs vLLM numerics)."""
    pairs = [(int(a), int(b)) for t in teacher for a, b in zip(t.accepted, t.replay_accepted)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))
