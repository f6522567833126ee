"""The SFT loop for any draft kind (its recipe: `drafts/<kind>/recipe.py`) through a DeepSpeed engine.

Reads top to bottom: ``run_sft(job)`` = set up (the recipe's draft, the feature source, the engine, resume) ->
train (AdamW, warm-up + cosine over ``sft.train_tokens`` trained tokens; stops at the first rule of the
`Budget`: ``sft.train_tokens``, ``sft.epochs`` passes, ``sft.study.max_flops`` training FLOPs, the optional
``sft.study.time_budget_min`` wall-clock cap on features + training) -> export checkpoints (at
``sft.study.curve_tokens`` and at the end). The loop carries its engine, state, clock and pending exports in one
`Loop`; a checkpoint keeps the `TrainState` part of it.

Checkpoints (`draft_opd_ray.checkpoint`): ``<run_dir>/checkpoints/sft/step_<n>/`` holds ``draft/`` (the folder
vLLM serves), ``deepspeed/`` (engine + optimizer state) and ``training_state.pt`` (step, elapsed time, data
position, FLOPs), then ``checkpoints/sft/latest`` names it. ``job.resume`` continues from ``latest``. Metrics
go to ``metrics.jsonl`` (one JSON object per step: stage, step, time, loss, loss_i, acc_i, lr, tokens_per_s,
flops_draft, flops_target).

Data-parallel ranks (`DPRank`; `sft/ranks.py` starts them as Ray actors): every rank
walks the same global batches and schedule and trains on its share of each batch (about equal tokens). The loss is
normalised by the global batch's counts (the recipe's ``reduce``) and scaled by the rank count, so that after
DeepSpeed averages the gradients L ranks update exactly as one rank on the whole batch; token counts, FLOPs and
the budgets are the global batch's. Rank 0 writes the exports, checkpoints and metrics rows.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from draft_opd_ray.checkpoint import clean_leftovers, latest_checkpoint, load_state, write_checkpoint
from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, OptimConfig, SFTConfig, TeacherConfig
from draft_opd_ray.device import actor_device, resolve_dtype
from draft_opd_ray.distributed import all_reduce_sum, balanced_shards, init_process_group, world
from draft_opd_ray.drafts.recipe import Recipe, RecipeInputs, Reduce
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.flops import feature_pass_flops, target_forward_flops
from draft_opd_ray.metrics import json_line
from draft_opd_ray.models.target import TargetInfo, read_target_info
from draft_opd_ray.optim import build_engine, lr_factor, step_with_grad_norm, trainable_parameters
from draft_opd_ray.sft.data import read_trajectories
from draft_opd_ray.sft.features import (
    FeatureCache,
    FeatureSpec,
    OnTheFlyFeatures,
    PassShare,
    SeqFeatures,
    forward_dtype,
    length_batches,
)

log = logging.getLogger(__name__)

MetricsCallback = Callable[[dict[str, Any]], None]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------------
# Batches and loss
# --------------------------------------------------------------------------------------------------


def mask_batch(lengths: Sequence[int], prompt_lens: Sequence[int]) -> dict[str, torch.Tensor]:
    """The masks of a right-padded batch of sequences of these lengths (input_ids all zero): what token counts and
    FLOPs of a batch need. loss_mask marks teacher positions p >= prompt_len - 1 (predicting response tokens)."""
    B, T = len(lengths), max(lengths)
    b = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.zeros(B, T, dtype=torch.bool),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
    }
    for j, (n, p) in enumerate(zip(lengths, prompt_lens)):
        b["attention_mask"][j, :n] = True
        b["loss_mask"][j, max(0, p - 1) : n] = True
    return b


def collate(items: Sequence[SeqFeatures], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Right-padded batch (masks: :func:`mask_batch`) with the features and soft labels."""
    b = mask_batch([int(s.input_ids.numel()) for s in items], [s.prompt_len for s in items])
    B, T = b["input_ids"].shape
    k, AH = items[0].topk_ids.shape[-1], items[0].features.shape[-1]
    b |= {
        "features": torch.zeros(B, T, AH, dtype=dtype),
        "topk_ids": torch.zeros(B, T, k, dtype=torch.long),
        "topk_p": torch.zeros(B, T, k),
        "top1": torch.zeros(B, T, dtype=torch.long),
    }
    for j, s in enumerate(items):
        n = int(s.input_ids.numel())
        b["input_ids"][j, :n] = s.input_ids
        b["features"][j, :n] = s.features.to(dtype)
        b["topk_ids"][j, :n], b["topk_p"][j, :n], b["top1"][j, :n] = s.topk_ids, s.topk_p, s.top1
    return b


def _barrier() -> None:
    """Every rank of the group waits here for the others (nothing with one rank)."""
    all_reduce_sum([0.0])


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The recipes' ``reduce``: ``t`` summed over the data-parallel group."""
    return torch.tensor(all_reduce_sum(t.flatten().tolist()), dtype=t.dtype, device=t.device).view_as(t)


# --------------------------------------------------------------------------------------------------
# The job, the budget and the loop's state
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SFTJob:
    """What `run_sft` trains: the run's sub-configs and what only the run knows (cache, seed, resume)."""

    sft: SFTConfig
    draft: DraftConfig
    optim: OptimConfig
    learner: LearnerConfig  # zero_stage, dtype, backend of the engine
    cache_dir: Path  # the feature cache goes under <cache_dir>/sft_features
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    seed: int = 0
    resume: bool = False  # continue from checkpoints/sft/latest
    init: str = "target"  # a new draft's initialisation (`drafts/eagle3/recipe.py`)
    feature_mode: str = "cache"  # cache: one feature pass, cached; on_the_fly: the target run per batch
    max_seq_len: int = 1024  # prompt + answer cut here
    max_steps: int | None = None  # a cap on steps (tests)


@dataclass(frozen=True)
class DPRank:
    """This process's place in the data-parallel group (module docstring): one rank alone by default."""

    rank: int = 0
    world_size: int = 1
    master: tuple[str, int] | None = None  # rank 0's rendezvous address (None: one rank)


@dataclass(frozen=True)
class Budget:
    """When SFT stops (the first rule reached ends it) and what it exports on the way. The study-only settings
    (``sft.study``: max_flops, time_budget_min, curve_tokens, start_from) are read here only."""

    train_tokens: int | None  # trained (loss) tokens; None: epochs only
    epochs: int  # passes over the answers (a cap)
    max_flops: float | None = None  # draft + target training FLOPs
    time_s: float = math.inf  # wall clock on features + training
    curve_tokens: tuple[int, ...] = ()  # extra exports at these trained-token counts
    start_from: str | None = (
        None  # continue an exported draft (the matched-FLOPs baseline) instead of a new one
    )
    max_steps: int | None = None  # a cap on steps (tests)

    @classmethod
    def of(cls, sft: SFTConfig, max_steps: int | None = None) -> Budget:
        study = sft.study
        return cls(
            train_tokens=sft.train_tokens,
            epochs=sft.epochs,
            max_flops=study.max_flops,
            time_s=math.inf if study.time_budget_min is None else study.time_budget_min * 60,
            curve_tokens=tuple(study.curve_tokens),
            start_from=study.start_from,
            max_steps=max_steps,
        )

    def total_steps(self, steps_per_epoch: int) -> int:
        """The steps the epochs (and the test cap) allow: the schedule's step count."""
        steps = steps_per_epoch * self.epochs
        return steps if self.max_steps is None else min(self.max_steps, steps)

    def spent(self, state: TrainState, out_of_time: bool) -> bool:
        """Whether any budget has ended: trained tokens, FLOPs, the wall-clock cap, or the test cap on steps."""
        return (
            out_of_time
            or (self.max_steps is not None and state.step >= self.max_steps)
            or (self.max_flops is not None and state.flops_draft + state.flops_target >= self.max_flops)
            or (self.train_tokens is not None and state.tokens >= self.train_tokens)
        )


def schedule_progress(
    step: int,
    total_steps: int,
    tokens: int,
    train_tokens: int | None,
    flops: float = 0.0,
    max_flops: float | None = None,
) -> float:
    """Where the lr schedule is, in [0, 1]: the largest of the step fraction (of ``sft.epochs``), the trained-token
    fraction of ``sft.train_tokens`` and the FLOPs fraction of ``sft.study.max_flops``: whichever budget ends
    training also ends the schedule. Never the wall clock, so a run is the same on any machine."""
    frac = step / max(1, total_steps)
    if train_tokens:
        frac = max(frac, tokens / train_tokens)
    if max_flops:
        frac = max(frac, flops / max_flops)
    return min(1.0, frac)


def progress_measure(
    state: TrainState, budget: Budget, total_steps: int, flops0: float
) -> tuple[float, float, str]:
    """The progress bar's (total, done, unit) in the budget that ends training: FLOPs for the matched-FLOPs arm
    (``sft.study.max_flops``), else trained tokens, else steps of ``sft.epochs``; so its ETA is the run's."""
    if budget.max_flops is not None:
        return budget.max_flops - flops0, state.flops_draft + state.flops_target - flops0, "FLOP"
    if budget.train_tokens is not None:
        return budget.train_tokens, state.tokens, "tok"
    return total_steps, state.step, "step"


def epoch_cap_note(tokens: int, epochs_done: int, epochs: int, train_tokens: int | None) -> str | None:
    """The warning when ``sft.epochs`` ends training before ``sft.train_tokens`` (at the tokens an epoch so far),
    else None: the token budget is the one users set, the epoch cap is only a guard."""
    if not train_tokens or epochs_done < 1:
        return None
    projected = round(tokens / epochs_done * epochs)
    if projected >= train_tokens:
        return None
    need = math.ceil(train_tokens / (tokens / epochs_done))
    return (
        f"sft.epochs={epochs} will end training at ~{projected:,} trained tokens ({tokens // epochs_done:,} an "
        f"epoch), before sft.train_tokens={train_tokens:,}: set sft.epochs={need} for the token budget"
    )


@dataclass
class TrainState:
    """What a checkpoint keeps of the loop (``training_state.pt``), so that a resumed run continues it."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    train_s: float = 0.0  # seconds spent in training steps (excludes feature building and checkpoints)
    budget_s_used: float = 0.0  # wall clock charged to the budget (features + training)
    train_start_s: float = 0.0  # budget seconds already used when training began (the feature cache)
    tokens: int = 0  # trained (loss) tokens
    flops_draft: float = 0.0
    flops_target: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    planned_steps: int = (
        0  # with sft.study.max_flops: the steps it allows, counted at step 0 (`planned_steps`)
    )


@dataclass
class Loop:
    """What the training loop carries: the engine and what feeds it, the persisted `TrainState`, the clock charged
    to the time budget, the curve marks still to export and where exports and metrics go."""

    engine: Any  # DeepSpeed engine over the recipe's model
    opt: Any  # its optimizer (the lr is set per step)
    recipe: Recipe
    source: FeatureCache | OnTheFlyFeatures
    state: TrainState
    info: TargetInfo
    dtype: torch.dtype  # the engine's precision, the features' too
    # which batches are charged a target forward (`target_charge`): "none" (cached features, charged up front),
    # "first_epoch" (a continued draft on cached features: each answer's forward once, where first used) or
    # "every_batch" (features on the fly: the target runs again every epoch)
    charge_target: str
    root: Path  # checkpoints/sft
    target: Path
    emit: MetricsCallback
    pending: list[int] = field(default_factory=list)  # curve marks (trained tokens) not yet exported
    flops0: float = 0.0  # FLOPs charged before the first step (the cached features'), outside the schedule
    start_used: float = 0.0  # budget seconds used when this process started training
    wall0: float = field(default_factory=time.monotonic)
    final: Path | None = None  # the last export

    def used_s(self) -> float:
        """Wall-clock seconds charged to the budget so far."""
        return self.start_used + (time.monotonic() - self.wall0)

    def flops(self) -> float:
        """Training FLOPs since the schedule began."""
        return self.state.flops_draft + self.state.flops_target - self.flops0


def save_checkpoint(
    engine: Any, state: TrainState, root: Path, target: str | os.PathLike[str], recipe: Recipe
) -> Path:
    """step_<n>/{draft/, deepspeed/, training_state.pt}, atomically; returns the draft folder. Rank 0 writes the
    folder; DeepSpeed's save is collective, so the other ranks write their part of it into rank 0's temporary
    folder, whose name rank 0 sends them."""
    name = f"step_{state.step}"
    state.checkpoints = [*state.checkpoints, name]
    rank, ranks = world()
    if rank != 0:
        tmp = _broadcast_path(None)
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
        return root / name / "draft"

    def fill(tmp: Path) -> None:
        recipe.save(copy.deepcopy(engine.module).to("cpu", torch.float32), tmp / "draft", target)
        if ranks > 1:
            _broadcast_path(tmp)
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
        torch.save(asdict(state), tmp / "training_state.pt")

    return write_checkpoint(root, name, fill) / "draft"


def _export(loop: Loop) -> None:
    """A checkpoint of the loop now, which becomes its last export."""
    loop.final = save_checkpoint(loop.engine, loop.state, loop.root, loop.target, loop.recipe)


def _broadcast_path(path: Path | None) -> Path:
    """Rank 0's ``path``, on every rank."""
    import torch.distributed as dist

    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0, device=actor_device() if dist.get_backend() == "nccl" else None)
    return Path(str(box[0]))


def _jsonl_writer(path: Path) -> MetricsCallback:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(m: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json_line(m))

    return write


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------


def _cache_path(trajectories: Path, recipe: Recipe, job: SFTJob) -> Path:
    """The feature cache folder of these trajectories for this recipe, teacher and stored precision."""
    topk = job.teacher.kept(len(recipe.label_ids))
    key = FeatureCache.key(
        trajectories,
        recipe.feature_ids,
        recipe.label_ids,
        topk,
        resolve_dtype(job.learner.dtype),
        forward_dtype(job.teacher.dtype),
    )
    return Path(job.cache_dir) / "sft_features" / key


def _feature_source(
    target: Path,
    trajectories: Path,
    recipe: Recipe,
    seqs: Sequence[Sequence[int]],
    plens: Sequence[int],
    job: SFTJob,
) -> FeatureCache | OnTheFlyFeatures:
    """Target features + the teacher's top-k soft labels (`teacher.topk`, null = the whole label vocabulary),
    the target run in `teacher.dtype` on this rank's device: built once and cached (``cache``; the ranks of the
    group share the pass, `FeatureCache.build`) or computed per batch."""
    aux, draft_ids = recipe.feature_ids, recipe.label_ids
    topk = job.teacher.kept(len(draft_ids))
    forward = forward_dtype(job.teacher.dtype)
    if job.feature_mode == "cache":
        spec = FeatureSpec(aux, draft_ids, topk, _DTYPES[resolve_dtype(job.learner.dtype)], forward)
        share = PassShare(*world(), barrier=_barrier)
        return FeatureCache.build(target, seqs, plens, _cache_path(trajectories, recipe, job), spec, share)
    if job.feature_mode == "on_the_fly":
        return OnTheFlyFeatures(target, seqs, plens, aux, draft_ids, topk, forward)
    raise ValueError(f"feature_mode must be 'cache' or 'on_the_fly', got {job.feature_mode!r}")


def _engine(model: torch.nn.Module, kind: str, job: SFTJob, place: DPRank) -> tuple[Any, Any]:
    """DeepSpeed engine (ZeRO stage and precision from ``learner``) over the weights both arms train; AdamW. The
    process joins the data-parallel group (one rank: a group of one) first."""
    learner, optim = job.learner, job.optim
    init_process_group(learner.backend, rank=place.rank, world_size=place.world_size, master=place.master)
    engine, opt, _ = build_engine(
        model,
        trainable_parameters(model, kind, job.draft.train_lm_head),
        lr=job.sft.lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        zero_stage=learner.zero_stage,
        dtype=resolve_dtype(learner.dtype),
        grad_clip=optim.grad_clip,
    )
    return engine, opt


def _sequences(trajectories: str | os.PathLike[str], max_seq_len: int) -> tuple[list[list[int]], list[int]]:
    """(prompt + response token ids, prompt lengths) of the trajectories with an answer, cut at max_seq_len."""
    rows = [r for r in read_trajectories(trajectories) if r.response_ids]
    seqs = [(r.prompt_ids + r.response_ids)[:max_seq_len] for r in rows]
    return seqs, [min(len(r.prompt_ids), max_seq_len) for r in rows]


def run_sft(
    job: SFTJob,
    target: str | os.PathLike[str],
    trajectories: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    metrics: MetricsCallback | None = None,
    progress: bool = True,
    place: DPRank = DPRank(),
) -> Path:
    """Train ``job.draft.kind``'s recipe on target trajectories; returns the final vLLM-loadable draft folder.

    Uses sft.{train_tokens, epochs, batch_tokens, lr} and the study-only settings read by :class:`Budget`, the
    draft's sizing, optim.{warmup_ratio, schedule, weight_decay, betas, grad_clip}, learner.{zero_stage, dtype,
    backend}. ``sft.study.curve_tokens``: extra exports at these trained-token counts (a tau-vs-compute curve);
    the last one is at the end. The optional wall-clock cap covers feature building and training.
    ``sft.study.start_from``: continue from an exported draft (its weights and vocabulary; fresh optimizer)
    instead of a new one; then the target forward of every batch is charged as if its features were computed on
    the fly (the matched-FLOPs baseline, P1). ``sft.study.max_flops``: stop once draft + target FLOPs reach it.

    ``place``: this process's place in the data-parallel group (module docstring); only rank 0 emits metrics and
    shows progress. The ranks share the feature pass, each on its own device, and each reads the cached rows of
    its share of a batch (`sft/features.py`).
    """
    t0 = time.monotonic()
    target, run_dir = Path(target), Path(run_dir)
    budget = Budget.of(job.sft, job.max_steps)
    if place.rank != 0:
        metrics, progress = (lambda m: None), False
    emit = metrics or _jsonl_writer(run_dir / "metrics.jsonl")
    info = read_target_info(target)
    seqs, plens = _sequences(trajectories, job.max_seq_len)
    src = RecipeInputs(seqs, plens, init=job.init, start_from=budget.start_from, seed=job.seed)
    recipe = draft_kind(job.draft.kind).recipe(target, job.draft, src)
    # the group first: the ranks split the feature pass and wait for each other's shards
    init_process_group(job.learner.backend, rank=place.rank, world_size=place.world_size, master=place.master)
    source = _feature_source(target, Path(trajectories), recipe, seqs, plens, job)
    feature_s = time.monotonic() - t0
    engine, opt = _engine(recipe.model, recipe.kind, job, place)
    root = run_dir / "checkpoints" / "sft"
    cached = job.feature_mode == "cache" and budget.start_from is None
    state = _start_state(engine, root, job.resume, feature_s, cached, info, seqs)
    loop = Loop(
        engine,
        opt,
        recipe,
        source,
        state,
        info,
        dtype=_DTYPES[resolve_dtype(job.learner.dtype)],
        charge_target=target_charge(job.feature_mode, budget.start_from is not None),
        root=root,
        target=target,
        emit=emit,
    )
    final = _train(loop, budget, job, progress)
    emit(
        {
            "stage": "sft",
            "step": state.step,
            "time": time.time(),
            "done": True,
            "feature_s": feature_s,
            "train_s": state.train_s,
            "budget_min": state.budget_s_used / 60,
            "tokens": state.tokens,
        }
    )
    return final


def _start_state(
    engine: Any, root: Path, resume: bool, feature_s: float, charge_cache: bool, info: Any, seqs: Any
) -> TrainState:
    """The training state to start from: the last checkpoint's (``resume``), or a fresh one charged with the
    feature pass (its time, and the target FLOPs of the cached features when ``charge_cache``)."""
    if world()[0] == 0:
        clean_leftovers(root)  # what a write killed half-way left
    last = latest_checkpoint(root, "training_state.pt") if resume else None
    if last is not None:
        engine.load_checkpoint(str(last / "deepspeed"), tag="state")
        state = TrainState(**load_state(last / "training_state.pt"))
        log.info("resumed from %s (step %d)", last, state.step)
        return state
    state = TrainState()
    state.budget_s_used = state.train_start_s = feature_s
    if charge_cache:
        state.flops_target = sum(target_forward_flops(info, 1, len(s)) for s in seqs)
    return state


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def target_charge(feature_mode: str, continued: bool) -> str:
    """Which batches pay a target forward, so that every target forward an arm needs is charged once, as the
    Draft-OPD arm's replay and the no-replay controls (one forward a rollout, reused over their passes) are:
    cached features of a fresh run are charged up front ("none" per batch); a continued draft
    (``sft.study.start_from``) reading cached features pays each answer's forward where first used
    ("first_epoch"); features on the fly run the target again every epoch ("every_batch")."""
    if feature_mode == "on_the_fly":
        return "every_batch"
    return "first_epoch" if continued else "none"


def charged(charge: str, epoch: int) -> bool:
    """Whether a batch of ``epoch`` pays its target forward under ``charge`` (`target_charge`)."""
    return charge == "every_batch" or (charge == "first_epoch" and epoch == 0)


def planned_steps(loop: Loop, budget: Budget, job: SFTJob, lengths: Sequence[int]) -> int:
    """The steps ``sft.study.max_flops`` allows, counted ahead from step 0: each epoch's batches in the order the
    loop takes them (`length_batches`) and each batch's FLOPs as the loop adds them (the draft's, and the target's
    where charged). The lr schedule runs over these steps, so it follows updates, as Draft-OPD's does, however
    unevenly the FLOPs fall on them (each answer's feature forward is charged in the first epoch only)."""
    assert budget.max_flops is not None
    plens = loop.source.prompt_lens
    spent, steps = loop.state.flops_draft + loop.state.flops_target, 0
    for epoch in range(budget.epochs):
        for idx in length_batches(lengths, job.sft.batch_tokens, job.seed + epoch):
            if spent >= budget.max_flops or (budget.max_steps is not None and steps >= budget.max_steps):
                return steps
            whole = mask_batch([lengths[i] for i in idx], [plens[i] for i in idx])
            spent += loop.recipe.flops(whole)
            if charged(loop.charge_target, epoch):
                B, T = whole["input_ids"].shape
                spent += feature_pass_flops(loop.info, B, T, int(whole["loss_mask"].sum()))
            steps += 1
    return steps


def _step_row(
    state: TrainState, loss: float, m: dict[str, float], lr: float, ntok: int, padded: int, dt: float
) -> dict[str, Any]:
    """One metrics.jsonl row of a training step."""
    return {
        "stage": "sft",
        "step": state.step,
        "time": time.time(),
        "loss": loss,
        **m,
        "lr": lr,
        "tokens_per_s": ntok / dt,
        "padded_tokens_per_s": padded / dt,
        "tokens": state.tokens,
        "epoch": state.epoch,
        "budget_min": state.budget_s_used / 60,
        "flops_draft": state.flops_draft,
        "flops_target": state.flops_target,
    }


def _out_of_time(used: float, budget_s: float) -> bool:
    """Whether the wall-clock cap is reached, on any rank (every rank stops at the same step)."""
    if math.isinf(budget_s):
        return False
    return all_reduce_sum([float(used >= budget_s)])[0] > 0


def _step(
    engine: Any,
    recipe: Recipe,
    source: FeatureCache | OnTheFlyFeatures,
    idx: Sequence[int],
    dtype: torch.dtype,
) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    """One optimizer step on the global batch ``idx``: this rank's share forward and backward on its device, then
    DeepSpeed's update on the gradients averaged over the ranks. Returns the global batch's loss and metrics
    (the ranks' shares summed) and its masks (:func:`mask_batch`), which token counts and FLOPs are taken from."""
    rank, ranks = world()
    lengths = [source.length(i) for i in idx]
    whole = mask_batch(lengths, [source.prompt_lens[i] for i in idx])
    share = [idx[j] for j in balanced_shards(lengths, ranks)[rank]]
    fetch = share or list(idx[:1])
    items = source.get_many(fetch) if isinstance(source, OnTheFlyFeatures) else [source.get(i) for i in fetch]
    batch = collate(items, dtype)
    if not share:  # fewer sequences than ranks: a forward that scores nothing keeps the collectives in step
        batch["loss_mask"].zero_()
    device = actor_device()
    batch = {k: v.to(device) for k, v in batch.items()}
    reduce: Reduce | None = _sum_over_ranks if ranks > 1 else None
    loss, m = recipe.loss(engine.module, batch, reduce=reduce)
    engine.backward(loss * ranks)  # DeepSpeed averages the ranks' gradients; the shares add up to the loss
    norm = step_with_grad_norm(engine)
    values = all_reduce_sum([float(loss.detach()), *m.values()])
    return values[0], {**dict(zip(m, values[1:])), "grad_norm": norm}, whole


def _train(loop: Loop, budget: Budget, job: SFTJob, progress: bool) -> Path:
    """The steps from ``loop.state`` on until a budget ends; checkpoints at the curve marks and at the end."""
    state, sft = loop.state, job.sft
    loop.start_used, loop.wall0 = state.budget_s_used, time.monotonic()
    loop.pending = sorted(t for t in budget.curve_tokens if t > state.tokens)
    loop.flops0 = 0.0 if state.step else state.flops_draft + state.flops_target  # the cached features' FLOPs
    lengths = [loop.source.length(i) for i in range(len(loop.source))]
    total_steps = budget.total_steps(len(length_batches(lengths, sft.batch_tokens, job.seed)))
    if budget.max_flops is not None and state.step == 0:
        state.planned_steps = planned_steps(loop, budget, job, lengths)
    if (
        state.planned_steps
    ):  # the schedule over the updates the FLOPs allow (a checkpoint before it: the fraction)
        total_steps = min(total_steps, state.planned_steps)
    total, initial, unit = progress_measure(state, budget, total_steps, loop.flops0)
    bar = tqdm(
        total=total, initial=initial, desc="sft", unit=unit, unit_scale=unit != "step", disable=not progress
    )
    while state.epoch < budget.epochs:
        batches = length_batches(lengths, sft.batch_tokens, job.seed + state.epoch)
        if not _epoch(loop, budget, job, batches, total_steps, bar):
            break
        state.epoch += 1
        state.batch_in_epoch = 0
        note = epoch_cap_note(state.tokens, state.epoch, budget.epochs, budget.train_tokens)
        if note and state.epoch == 1 and world()[0] == 0:
            log.warning(note)
    bar.close()
    note = epoch_cap_note(state.tokens, state.epoch, budget.epochs, budget.train_tokens)
    if note and state.epoch >= budget.epochs and world()[0] == 0:
        log.warning(note.replace("will end", "ended"))
    if loop.final is None or state.checkpoints[-1] != f"step_{state.step}":
        _export(loop)
    assert loop.final is not None
    return loop.final


def _epoch(
    loop: Loop, budget: Budget, job: SFTJob, batches: Sequence[Sequence[int]], total_steps: int, bar: Any
) -> bool:
    """The rest of this epoch's batches; False when a budget ended it before its last batch."""
    state = loop.state
    while state.batch_in_epoch < len(batches):
        if budget.spent(state, _out_of_time(loop.used_s(), budget.time_s)):
            return False
        progress_frac = schedule_progress(
            state.step,
            total_steps,
            state.tokens,
            budget.train_tokens,
            loop.flops(),
            None if budget.max_flops is None or state.planned_steps else budget.max_flops - loop.flops0,
        )
        lr = job.sft.lr * lr_factor(progress_frac, job.optim.warmup_ratio, job.optim.schedule)
        for g in loop.opt.param_groups:
            g["lr"] = lr
        tic = time.monotonic()
        loss, m, batch = _step(
            loop.engine, loop.recipe, loop.source, batches[state.batch_in_epoch], loop.dtype
        )
        dt = time.monotonic() - tic
        B, T = batch["input_ids"].shape
        ntok = int(batch["loss_mask"].sum())
        state.step += 1
        state.batch_in_epoch += 1
        state.train_s += dt
        state.tokens += ntok
        state.flops_draft += loop.recipe.flops(batch)
        if charged(loop.charge_target, state.epoch):
            state.flops_target += feature_pass_flops(loop.info, B, T, ntok)
        state.budget_s_used = loop.used_s()
        loop.emit(_step_row(state, loss, m, lr, ntok, B * T, dt))
        bar.update(progress_measure(state, budget, total_steps, loop.flops0)[1] - bar.n)
        bar.set_postfix(
            step=state.step,
            loss=f"{loss:.3f}",
            acc=f"{m.get('acc_0', m.get('acc_1', 0)):.2f}",
            tok_s=f"{ntok / dt:.0f}",
        )
        if loop.pending and state.tokens >= loop.pending[0]:
            loop.pending = [p for p in loop.pending if p > state.tokens]
            _export(loop)
    return True
