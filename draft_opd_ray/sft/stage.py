"""The `sft` stage of a run: target trajectories (cached) → SFT of the configured draft kind → exported draft.

A finished warm start is cached under `<cache>/warm_starts/<key>/draft`, keyed by the target, the prompts and
the SFT/draft settings, so later runs with the same settings reuse it (`sft.reuse=false` retrains).

Where it trains: with a ``reservation`` (a run on Ray) on the `cluster.learner_ranks` learner ranks, as one
data-parallel group (`sft/ranks.py`), which also share the target's feature pass on their devices; without one
in this process, as a group of one. The answers (vLLM) are made in the reservation's rollout bundle 0
(`slot_call`), or here without one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.device import resolve_dtype
from draft_opd_ray.distributed import release_process_group
from draft_opd_ray.placement import Reservation


def _sft_key(cfg: Config) -> dict[str, Any]:
    """The SFT settings that change the trained draft: all but ``reuse`` and the extra exports
    (``sft.study.curve_tokens``); the answers' precision as this hardware resolves ``auto``."""
    d = dataclasses.asdict(cfg.sft)
    d.pop("reuse")
    d["study"].pop("curve_tokens")
    d["trajectory_dtype"] = resolve_dtype(d["trajectory_dtype"])
    return d


def _teacher_key(cfg: Config) -> dict[str, Any]:
    """The teacher settings the SFT pass reads: precision and top-k, not where Draft-OPD takes its teacher from
    (``source``), so a warm start is shared by both sources."""
    d = dataclasses.asdict(cfg.teacher)
    d.pop("source")
    return d


def _key(cfg: Config, target: str, prompts: Sequence[Sequence[int]], stop: Sequence[int]) -> str:
    """The warm start's cache key: the target, the settings that change the draft, the prompts and the ids that end
    the target's answers."""
    parts: list[Any] = [
        target,
        _sft_key(cfg),
        dataclasses.asdict(cfg.draft),
        dataclasses.asdict(cfg.optim),
        _teacher_key(cfg),
        resolve_dtype(cfg.learner.dtype),
        cfg.seed,
        {"stop_token_ids": list(stop)},
    ]
    h = hashlib.sha256()
    h.update(json.dumps(parts, sort_keys=True).encode())
    for p in prompts:
        h.update(json.dumps(list(p)).encode())
    return h.hexdigest()[:16]


def log_sft_row(metrics: Any, row: dict[str, Any]) -> None:
    """The trainer's rows carry stage/step/time of their own; the run's logger sets those."""
    extra = {k: v for k, v in row.items() if k not in ("stage", "step", "time")}
    metrics.log("sft", int(row.get("step", 0)), **extra)


def dataset_answers(cfg: Config, tokenizer: Any, skip: int) -> list[Any]:
    """``sft.dataset_answers`` prompts of data.train's source and split, after its first ``skip`` (those the
    run trains and rolls out on), that carry the data set's own answer (``Prompt.meta["answer"]``)."""
    from draft_opd_ray.data.prompts import load_prompt_set

    n = cfg.sft.dataset_answers
    if n <= 0:
        return []
    more = dataclasses.replace(cfg.data.train, max_prompts=skip + 2 * n)
    ps = load_prompt_set(
        more,
        tokenizer,
        chat_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
        key="data.train",
    )
    out = [p for p in ps.prompts[skip:] if p.meta.get("answer")][:n]
    print(
        f"[sft] {len(out)} data-set answers (of {n} asked) scored by the target join the SFT data", flush=True
    )
    return out


def run_sft_stage(
    cfg: Config,
    *,
    target: str,
    prompts: Sequence[list[int]],
    run_dir: Path,
    metrics: Any,
    reservation: Reservation | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> Path:
    """The warm start's draft folder (cached, or trained now). ``stop_token_ids``: the ids that end the target's
    answers (None: the target's own, `models.target.stop_token_ids`)."""
    from transformers import AutoTokenizer

    from draft_opd_ray.cache import default_cache_dir
    from draft_opd_ray.models.target import read_target_info
    from draft_opd_ray.models.target import stop_token_ids as target_stops
    from draft_opd_ray.sft.data import answer_trajectories, generate_trajectories, mix_trajectories
    from draft_opd_ray.slot_call import call_in_slot

    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    tokenizer = AutoTokenizer.from_pretrained(target)
    stop = (
        tuple(stop_token_ids)
        if stop_token_ids is not None
        else target_stops(read_target_info(target), tokenizer)
    )
    extra = dataset_answers(cfg, tokenizer, skip=len(prompts))
    prompts = list(prompts)[: cfg.sft.num_prompts]
    key = _key(cfg, target, [*prompts, *(list(p.token_ids) for p in extra)], stop)
    warm = cache / "warm_starts" / key / "draft"
    if cfg.sft.reuse and (warm / "config.json").is_file():
        print(f"[sft] reusing warm start {warm}", flush=True)
        (run_dir / "warm_start").write_text(f"{warm}\n")  # which cached draft this run's sft stage was
        return warm
    traj = call_in_slot(  # a vLLM engine over the target: in a rollout bundle when Ray runs the stage
        reservation,
        "sft: the target's answers",
        generate_trajectories,
        target,
        prompts,
        cache,
        stop_token_ids=stop,
        max_new_tokens=cfg.sft.max_new_tokens,
        max_model_len=cfg.target.max_model_len,
        kvcache_gb=cfg.rollout.kvcache_gb,
        dtype=resolve_dtype(cfg.sft.trajectory_dtype),
    )
    if extra:
        rows = answer_trajectories(
            [p.token_ids for p in extra],
            [p.meta["answer"] for p in extra],
            tokenizer,
            max_new_tokens=cfg.sft.max_new_tokens,
            eos_token_id=next(iter(stop), None),  # the target's primary eos, as its own answers end
        )
        traj = mix_trajectories(traj, rows, cache)
    draft = _train(cfg, target, traj, run_dir, cache, lambda m: log_sft_row(metrics, m), reservation)
    cache_warm_start(Path(draft), warm)
    return Path(draft)


def cache_warm_start(draft: Path, warm: Path) -> None:
    """``draft`` copied to the cache's ``warm`` folder whole: copied beside it, then renamed into place; a warm start
    already there (`sft.reuse=false` retrains it) is renamed aside first and removed after, as a folder cannot be
    renamed over a full one."""
    tmp, old = warm.parent / ".draft.tmp", warm.parent / ".draft.old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(draft, tmp)
    if warm.exists():
        warm.replace(old)
    tmp.replace(warm)
    shutil.rmtree(old, ignore_errors=True)


def _train(
    cfg: Config,
    target: str,
    traj: Path,
    run_dir: Path,
    cache: Path,
    log_row: Callable[[dict[str, Any]], None],
    reservation: Reservation | None,
) -> Path:
    """`run_sft` in this process, or on the learner ranks of the reservation (features included)."""
    from draft_opd_ray.sft.ranks import run_sft_ranks
    from draft_opd_ray.sft.trainer import SFTJob, run_sft

    job = SFTJob(
        sft=cfg.sft,
        draft=cfg.draft,
        optim=cfg.optim,
        learner=cfg.learner,
        cache_dir=cache,
        teacher=cfg.teacher,
        seed=cfg.seed,
        resume=bool(cfg.resume),
    )
    if reservation is None:
        draft = run_sft(job, target, traj, run_dir, metrics=log_row)
        release_process_group()
        return draft
    return run_sft_ranks(
        reservation,
        cfg.cluster.learner_ranks,
        job,
        target,
        traj,
        run_dir,
        metrics=log_row,
        cpu_threads=cfg.cluster.gpus_per_node == 0,
    )
