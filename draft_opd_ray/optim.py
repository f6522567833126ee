"""What the SFT arm and the Draft-OPD learner share, so that the two differ only in data and objective:
which weights train, the learning-rate schedule, and the AdamW + DeepSpeed engine (ZeRO stage, precision).

Trained weights: every draft weight except the frozen target token embedding; an EAGLE-3 head's LM head only
with ``draft.train_lm_head`` (off by default: the target's rows of the draft vocabulary). Both arms call
:func:`trainable_parameters`, so a comparison never pits 9.8M trained weights against 5.1M.

Optimizer state for checkpoints (`optimizer_state` / `load_optimizer_state`): the engine's optimizer state as CPU
tensors and plain data, so that the driver needs no GPU to hold it and `checkpoint.load_state` (weights_only) reads
it back; DeepSpeed's own `state_dict` holds objects (ZeRO's fragment addresses, loss scaler, stage enum).

Schedule: linear warm-up over ``warmup`` of training, then cosine to ``floor`` x peak (or constant). Draft-OPD
starts where SFT ended: its default peak ``optim.lr`` = 1e-4 is the SFT schedule's last lr (``sft.lr`` 1e-3 x
floor 0.1), reached after a short warm-up of the fresh AdamW moments, so the lr never jumps above the warm
start's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from draft_opd_ray.drafts.registry import draft_kind

LR_FLOOR = 0.1  # the cosine ends at this fraction of the peak


def lr_factor(progress: float, warmup: float, schedule: str, floor: float = LR_FLOOR) -> float:
    """Warm-up then cosine to ``floor`` x peak (or constant), as a function of training progress in [0, 1]."""
    if warmup > 0 and progress < warmup:
        return max(progress / warmup, 1e-3)
    if schedule == "constant":
        return 1.0
    x = min(1.0, (progress - warmup) / max(1e-9, 1 - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x))


def update_lr_factor(update: int, total: int, warmup: float, schedule: str) -> float:
    """The factor of the peak lr at optimizer update ``update`` (0-based) of ``total``: the first update already
    moves (progress 1/total), the last one sits at the floor."""
    return lr_factor((update + 1) / max(1, total), warmup, schedule)


def trainable_parameters(model: Any, kind: str, train_lm_head: bool) -> list[Any]:
    """Set which weights train (module docstring) and return them."""
    if draft_kind(kind).lm_head_option:
        model.lm_head.weight.requires_grad_(train_lm_head)
    return [p for p in model.parameters() if p.requires_grad]


def deepspeed_config(*, zero_stage: int, dtype: str, grad_clip: float) -> dict[str, Any]:
    """One micro-batch per step (the callers accumulate their own micro-batches into one loss); ``dtype`` is the
    resolved `learner.dtype`: bfloat16 / float16 train in mixed precision with fp32 master weights."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


def build_engine(
    model: Any,
    params: Sequence[Any],
    *,
    lr: float,
    betas: Sequence[float],
    weight_decay: float,
    zero_stage: int,
    dtype: str,
    grad_clip: float,
    lr_lambda: Callable[[int], float] | None = None,
) -> tuple[Any, Any, Any]:
    """(DeepSpeed engine, optimizer, lr scheduler or None): AdamW over ``params``; ``lr_lambda`` (update index
    -> factor of ``lr``) makes a LambdaLR that the engine steps, else the caller sets the lr itself."""
    import deepspeed
    import torch

    from draft_opd_ray.checkpoint import safe_checkpoint_engine

    opt = torch.optim.AdamW(list(params), lr=lr, betas=(betas[0], betas[1]), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    engine, _, _, sched = deepspeed.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=sched,
        config=deepspeed_config(zero_stage=zero_stage, dtype=dtype, grad_clip=grad_clip),
    )
    engine.checkpoint_engine = safe_checkpoint_engine()  # load_checkpoint unpickles nothing
    return engine, opt, sched


def step_with_grad_norm(engine: Any) -> float:
    """``engine.step()``, returning the update's gradient 2-norm before clipping (NaN where none is known): the
    norm DeepSpeed's optimizer took (bf16, fp16, ZeRO), else the norm of the parameters' gradients, which under
    ZeRO stage 0 are whole on every rank after backward (DeepSpeed's float32 path clips without keeping it)."""
    import torch

    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    local = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else math.nan
    engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else local


def optimizer_state(optimizer: Any) -> dict[str, Any]:
    """``optimizer`` (``engine.optimizer``: torch's, DeepSpeed's mixed-precision or ZeRO-1/2 wrapper)'s state as
    CPU tensors and plain data (DeepSpeed's objects as `checkpoint.deepspeed_plain` writes them): what
    `load_optimizer_state` restores exactly."""
    from draft_opd_ray.checkpoint import deepspeed_plain, plain

    return plain(deepspeed_plain(optimizer.state_dict()))  # type: ignore[no-any-return]


def load_optimizer_state(optimizer: Any, state: dict[str, Any], device: Any) -> None:
    """Restore `optimizer_state`'s output (read on the CPU) into ``optimizer`` on ``device``. ZeRO reads its state
    from a list indexed by data-parallel rank (only this rank's entry, for the same rank count), and takes its fp32
    master partition from the state instead of re-widening the bf16/fp16 weights, as DeepSpeed's own resume
    does: the resumed run then continues exactly."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from draft_opd_ray.checkpoint import deepspeed_objects, to_device
    from draft_opd_ray.distributed import world

    sd = deepspeed_objects(to_device(state, device))
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        rank, size = world()
        optimizer.load_state_dict([sd if r == rank else {} for r in range(size)], load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(sd)
