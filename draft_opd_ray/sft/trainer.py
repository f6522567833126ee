"""The SFT loop for any draft kind (its recipe: `sft/recipes.py`) through a DeepSpeed engine.

Reads top to bottom: ``run_sft`` = set up (the recipe's draft, the feature source, the engine, resume) -> train
(AdamW, warm-up + cosine; stops at the first of: ``sft.epochs`` passes, ``sft.max_flops`` training FLOPs,
``sft.time_budget_min`` minutes of features + training) -> export checkpoints.

Checkpoints (`draft_opd_ray.checkpoint`): ``<run_dir>/checkpoints/sft/step_<n>/`` holds ``draft/`` (the folder
vLLM serves), ``deepspeed/`` (engine + optimizer state) and ``training_state.pt`` (step, elapsed time, data
position, FLOPs), then ``checkpoints/sft/latest`` names it. ``resume=True`` continues from ``latest``. Metrics
go to ``metrics.jsonl`` (one JSON object per step: stage, step, time, loss, loss_i, acc_i, lr, tokens_per_s,
flops_draft, flops_target).
"""

from __future__ import annotations

import copy
import json
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

from draft_opd_ray.checkpoint import latest_checkpoint, write_checkpoint
from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, OptimConfig, SFTConfig
from draft_opd_ray.device import resolve_dtype
from draft_opd_ray.distributed import init_process_group
from draft_opd_ray.flops import target_forward_flops
from draft_opd_ray.models.target import read_target_info
from draft_opd_ray.sft.data import read_trajectories
from draft_opd_ray.sft.features import FeatureCache, OnTheFlyFeatures, SeqFeatures, length_batches
from draft_opd_ray.sft.recipes import Recipe, build_recipe

log = logging.getLogger(__name__)

MetricsCallback = Callable[[dict[str, Any]], None]
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# --------------------------------------------------------------------------------------------------
# Batches and loss
# --------------------------------------------------------------------------------------------------


def collate(items: Sequence[SeqFeatures], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Right-padded batch. loss_mask marks teacher positions p >= prompt_len - 1 (predicting response tokens)."""
    B, T = len(items), max(int(s.input_ids.numel()) for s in items)
    k, AH = items[0].topk_ids.shape[-1], items[0].features.shape[-1]
    b = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "attention_mask": torch.zeros(B, T, dtype=torch.bool),
        "features": torch.zeros(B, T, AH, dtype=dtype),
        "topk_ids": torch.zeros(B, T, k, dtype=torch.long),
        "topk_p": torch.zeros(B, T, k),
        "top1": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
    }
    for j, s in enumerate(items):
        n = int(s.input_ids.numel())
        b["input_ids"][j, :n] = s.input_ids
        b["attention_mask"][j, :n] = True
        b["features"][j, :n] = s.features.to(dtype)
        b["topk_ids"][j, :n], b["topk_p"][j, :n], b["top1"][j, :n] = s.topk_ids, s.topk_p, s.top1
        b["loss_mask"][j, max(0, s.prompt_len - 1) : n] = True
    return b


# --------------------------------------------------------------------------------------------------
# Schedule and state
# --------------------------------------------------------------------------------------------------


def lr_factor(progress: float, warmup: float, schedule: str, floor: float = 0.1) -> float:
    """Warm-up then cosine to ``floor`` x peak (or constant), as a function of training progress in [0, 1]."""
    if warmup > 0 and progress < warmup:
        return max(progress / warmup, 1e-3)
    if schedule == "constant":
        return 1.0
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


def schedule_progress(
    step: int, total_steps: int, used_s: float, budget_s: float, train_start_s: float
) -> float:
    """Where the lr schedule is, in [0, 1]: the larger of the step fraction and the fraction of the *training*
    part of the time budget used (the budget seconds the feature cache took before training are not the
    schedule's: a cold run whose cache took 28% of the budget would otherwise skip its warm-up)."""
    train_frac = (used_s - train_start_s) / max(1e-9, budget_s - train_start_s)
    return min(1.0, max(step / max(1, total_steps), train_frac))


@dataclass
class TrainState:
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


def save_checkpoint(
    engine: Any, state: TrainState, root: Path, target: str | os.PathLike[str], recipe: Recipe
) -> Path:
    """step_<n>/{draft/, deepspeed/, training_state.pt}, atomically; returns the draft folder."""
    name = f"step_{state.step}"
    state.checkpoints = [*state.checkpoints, name]

    def fill(tmp: Path) -> None:
        recipe.save(copy.deepcopy(engine.module).float(), tmp / "draft", target)
        engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False)
        torch.save(asdict(state), tmp / "training_state.pt")

    return write_checkpoint(root, name, fill) / "draft"


def _jsonl_writer(path: Path) -> MetricsCallback:
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(m: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(m) + "\n")

    return write


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _feature_source(
    target: Path,
    trajectories: Path,
    recipe: Recipe,
    seqs: Sequence[Sequence[int]],
    plens: Sequence[int],
    *,
    mode: str,
    topk: int,
    dtype_name: str,
    cache_dir: str | os.PathLike[str],
) -> FeatureCache | OnTheFlyFeatures:
    """Target features + top-k soft labels: built once and cached (``cache``) or computed per batch."""
    aux, draft_ids = recipe.feature_ids, recipe.label_ids
    if mode == "cache":
        key = FeatureCache.key(trajectories, aux, draft_ids, topk, dtype_name)
        return FeatureCache.build(
            target,
            seqs,
            plens,
            Path(cache_dir) / "sft_features" / f"{key}.safetensors",
            aux,
            draft_ids,
            topk=topk,
            dtype=_DTYPES[dtype_name],
        )
    if mode == "on_the_fly":
        return OnTheFlyFeatures(target, seqs, plens, aux, draft_ids, topk)
    raise ValueError(f"feature_mode must be 'cache' or 'on_the_fly', got {mode!r}")


def _engine(
    model: torch.nn.Module, sft: SFTConfig, optim: OptimConfig, learner: LearnerConfig
) -> tuple[Any, Any]:
    """DeepSpeed engine (ZeRO stage and precision from ``learner``) over the trainable parameters; AdamW."""
    import deepspeed

    init_process_group(learner.backend)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=sft.lr, betas=(optim.betas[0], optim.betas[1]), weight_decay=optim.weight_decay
    )
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": learner.zero_stage},
        "bf16": {"enabled": resolve_dtype(learner.dtype) == "bfloat16"},
        "fp16": {"enabled": learner.dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    return engine, opt


def run_sft(
    target: str | os.PathLike[str],
    trajectories: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    sft: SFTConfig,
    draft: DraftConfig,
    optim: OptimConfig,
    learner: LearnerConfig,
    cache_dir: str | os.PathLike[str],
    init: str = "target",
    feature_mode: str = "cache",
    topk: int = 16,
    max_seq_len: int = 1024,
    max_steps: int | None = None,
    resume: bool = False,
    seed: int = 0,
    metrics: MetricsCallback | None = None,
    progress: bool = True,
) -> Path:
    """Train ``draft.kind``'s recipe on target trajectories; returns the final vLLM-loadable draft folder.

    Uses sft.{epochs, batch_tokens, lr, time_budget_min, curve_minutes, start_from, max_flops}, the draft's
    sizing, optim.{warmup_ratio, schedule, weight_decay, betas, grad_clip}, learner.{zero_stage, dtype,
    backend}. ``sft.curve_minutes``: extra exports at these budget minutes (a tau-vs-time curve); the last one is
    at the end. ``max_steps`` caps steps (tests). The budget clock covers feature building and training.
    ``sft.start_from``: continue from an exported draft (its weights and vocabulary; fresh optimizer) instead of
    a new one; then the target forward of every batch is charged as if its features were computed on the fly
    (the matched-FLOPs baseline, P1). ``sft.max_flops``: stop once draft + target FLOPs reach it.
    """
    t0 = time.monotonic()
    target, run_dir = Path(target), Path(run_dir)
    root = run_dir / "checkpoints" / "sft"
    emit = metrics or _jsonl_writer(run_dir / "metrics.jsonl")
    info = read_target_info(target)

    rows = read_trajectories(trajectories)
    seqs = [(r.prompt_ids + r.response_ids)[:max_seq_len] for r in rows if r.response_ids]
    plens = [min(len(r.prompt_ids), max_seq_len) for r in rows if r.response_ids]
    recipe = build_recipe(
        target, draft, seqs=seqs, prompt_lens=plens, init=init, start_from=sft.start_from, seed=seed
    )
    source = _feature_source(
        target,
        Path(trajectories),
        recipe,
        seqs,
        plens,
        mode=feature_mode,
        topk=topk,
        dtype_name=resolve_dtype(learner.dtype),
        cache_dir=cache_dir,
    )
    feature_s = time.monotonic() - t0
    engine, opt = _engine(recipe.model, sft, optim, learner)

    state = TrainState()
    last = latest_checkpoint(root, "training_state.pt") if resume else None
    if last is not None:
        engine.load_checkpoint(str(last / "deepspeed"), tag="state")
        state = TrainState(**torch.load(last / "training_state.pt", weights_only=False))
        log.info("resumed from %s (step %d)", last, state.step)
    else:
        state.budget_s_used = state.train_start_s = feature_s
        if feature_mode == "cache" and sft.start_from is None:
            state.flops_target = sum(target_forward_flops(info, 1, len(s)) for s in seqs)
    charge_target = feature_mode == "on_the_fly" or sft.start_from is not None
    final = _train(
        engine,
        opt,
        recipe,
        source,
        state,
        sft,
        optim,
        learner,
        info,
        root,
        target,
        emit,
        max_steps=max_steps,
        seed=seed,
        charge_target=charge_target,
        progress=progress,
    )
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


def _train(
    engine: Any,
    opt: Any,
    recipe: Recipe,
    source: FeatureCache | OnTheFlyFeatures,
    state: TrainState,
    sft: SFTConfig,
    optim: OptimConfig,
    learner: LearnerConfig,
    info: Any,
    root: Path,
    target: Path,
    emit: MetricsCallback,
    *,
    max_steps: int | None,
    seed: int,
    charge_target: bool,
    progress: bool,
) -> Path:
    """The steps from ``state`` on until a budget ends; checkpoints at ``sft.curve_minutes`` and at the end."""
    budget_s = sft.time_budget_min * 60
    dtype = _DTYPES[resolve_dtype(learner.dtype)]
    start_used, wall0 = state.budget_s_used, time.monotonic()
    pending = sorted(m * 60 for m in sft.curve_minutes if m * 60 > state.budget_s_used)
    lengths = [source.length(i) for i in range(len(source))]
    steps_per_epoch = len(length_batches(lengths, sft.batch_tokens, seed))
    total_steps = (
        steps_per_epoch * sft.epochs if max_steps is None else min(max_steps, steps_per_epoch * sft.epochs)
    )
    bar = tqdm(total=total_steps, initial=state.step, desc="sft", disable=not progress)
    final: Path | None = None
    while state.epoch < sft.epochs:
        batches = length_batches(lengths, sft.batch_tokens, seed + state.epoch)
        while state.batch_in_epoch < len(batches):
            used = start_used + (time.monotonic() - wall0)
            if used >= budget_s or (max_steps is not None and state.step >= max_steps):
                break
            if sft.max_flops is not None and state.flops_draft + state.flops_target >= sft.max_flops:
                break
            progress_frac = schedule_progress(state.step, total_steps, used, budget_s, state.train_start_s)
            lr = sft.lr * lr_factor(progress_frac, optim.warmup_ratio, optim.schedule)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = batches[state.batch_in_epoch]
            tic = time.monotonic()
            items = (
                source.get_many(idx) if isinstance(source, OnTheFlyFeatures) else [source.get(i) for i in idx]
            )
            batch = collate(items, dtype)
            loss, m = recipe.loss(engine.module, batch)
            engine.backward(loss)
            engine.step()
            dt = time.monotonic() - tic
            B, T = batch["input_ids"].shape
            ntok = int(batch["loss_mask"].sum())
            state.step += 1
            state.batch_in_epoch += 1
            state.train_s += dt
            state.tokens += ntok
            state.flops_draft += recipe.flops(batch)
            if charge_target:
                state.flops_target += target_forward_flops(info, B, T)
            state.budget_s_used = start_used + (time.monotonic() - wall0)
            rec = {"stage": "sft", "step": state.step, "time": time.time(), "loss": float(loss.detach()), **m}
            rec |= {
                "lr": lr,
                "tokens_per_s": ntok / dt,
                "padded_tokens_per_s": B * T / dt,
                "tokens": state.tokens,
            }
            rec |= {"epoch": state.epoch, "budget_min": state.budget_s_used / 60}
            rec |= {"flops_draft": state.flops_draft, "flops_target": state.flops_target}
            emit(rec)
            bar.update(1)
            bar.set_postfix(
                loss=f"{float(loss.detach()):.3f}",
                acc=f"{m.get('acc_0', m.get('acc_1', 0)):.2f}",
                tok_s=f"{ntok / dt:.0f}",
            )
            if pending and state.budget_s_used >= pending[0]:
                pending = [p for p in pending if p > state.budget_s_used]
                final = save_checkpoint(engine, state, root, target, recipe)
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
        break
    bar.close()
    if final is None or state.checkpoints[-1] != f"step_{state.step}":
        final = save_checkpoint(engine, state, root, target, recipe)
    return final
