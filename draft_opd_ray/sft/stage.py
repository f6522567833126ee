"""The `sft` stage of a run: target trajectories (cached) → SFT of the configured draft kind → exported draft.

A finished warm start is cached under `<cache>/warm_starts/<key>/draft`, keyed by the target, the prompts and
the SFT/draft settings, so later runs with the same settings reuse it (`sft.reuse=false` retrains).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config


def _key(cfg: Config, target: str, prompts: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps(
            [
                target,
                dataclasses.asdict(cfg.sft),
                dataclasses.asdict(cfg.draft),
                dataclasses.asdict(cfg.optim),
                cfg.learner.dtype,
                cfg.seed,
            ],
            sort_keys=True,
        ).encode()
    )
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:16]


def release_process_group() -> None:
    """The trainer's single-process group is done: free its port before Ray actors start their own."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(k, None)


def log_sft_row(metrics: Any, row: dict[str, Any]) -> None:
    """The trainer's rows carry stage/step/time of their own; the run's logger sets those."""
    extra = {k: v for k, v in row.items() if k not in ("stage", "step", "time")}
    metrics.log("sft", int(row.get("step", 0)), **extra)


def run_sft_stage(
    cfg: Config, *, target: str, prompts: Sequence[list[int]], run_dir: Path, metrics: Any
) -> Path:
    from draft_opd_ray.models.target import default_cache_dir
    from draft_opd_ray.sft.data import generate_trajectories
    from draft_opd_ray.sft.trainer import run_sft

    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    prompts = list(prompts)[: cfg.sft.num_prompts]
    warm = cache / "warm_starts" / _key(cfg, target, prompts) / "draft"
    if cfg.sft.reuse and (warm / "config.json").is_file():
        print(f"[sft] reusing warm start {warm}", flush=True)
        return warm
    traj = generate_trajectories(
        target,
        prompts,
        cache,
        max_new_tokens=cfg.sft.max_new_tokens,
        max_model_len=cfg.target.max_model_len,
        kvcache_gb=cfg.rollout.kvcache_gb,
    )
    draft = run_sft(
        target,
        traj,
        run_dir,
        sft=cfg.sft,
        draft=cfg.draft,
        optim=cfg.optim,
        learner=cfg.learner,
        cache_dir=cache,
        resume=cfg.resume,
        seed=cfg.seed,
        metrics=lambda m: log_sft_row(metrics, m),
    )
    release_process_group()
    tmp = warm.parent / ".draft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(draft, tmp)
    tmp.replace(warm)
    return Path(draft)
