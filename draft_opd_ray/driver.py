"""Single-controller driver: runs the requested stages in Hydra's run directory.

    prepare   target folder (embedded default converted once), draft-vs-target check, prompt sets
    sft       warm start (or baseline) of the draft                      -> checkpoints/sft/...
    opd       the Draft-OPD loop on Ray (draft_opd_ray.loop.opd)          -> checkpoints/opd/...
    eval      τ, per-position acceptance, speed-up, ngram beside it       -> eval/report.{json,md}, plots
Around the stages that run on Ray (`ray_stages`): connect, check cluster.storage_dir, reserve the plan
(draft_opd_ray.cluster); the reservation is released and Ray shut down after the last stage. With a reservation the
driver holds no model: the SFT answers and eval's engines run in a rollout bundle (`slot_call`).
Everything heavy starts only after the config and the data have been checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draft_opd_ray.config.schema import Config, PromptSetConfig, eval_sets
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.metrics import MetricsLogger
from draft_opd_ray.placement import PlacementPlan

if TYPE_CHECKING:
    from draft_opd_ray.cluster import Reservation

# Stages whose actors run on Ray: the run connects and reserves the plan once, before the first stage.
RAY_STAGES = ("sft", "opd")


def ray_stages(cfg: Config) -> tuple[str, ...]:
    """The stages that need the reservation. On a GPU cluster eval too: its engines then run in a rollout bundle,
    on GPUs Ray accounts for, never on the driver's node's GPU (`slot_call`)."""
    return (*RAY_STAGES, "eval") if cfg.cluster.gpus_per_node > 0 else RAY_STAGES


def prepare_target(cfg: Config) -> tuple[str, Any, Any]:
    """The target folder (the embedded default converted once), its tokenizer and its config-only info."""
    from transformers import AutoTokenizer

    from draft_opd_ray.models.target import read_target_info, resolve_target_path

    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    target = resolve_target_path(cfg.target.path, cache)
    info = read_target_info(target)
    kind = draft_kind(cfg.draft.kind)
    kind.check_fits(cfg.draft, info.num_layers, info.vocab_size)
    if cfg.draft.path is not None:
        kind.check_folder(target, cfg.draft.path)
    # a run that was not preflighted (check_teacher, benchmarks, notebooks) is sized here
    if cfg.target.max_model_len is None:
        from draft_opd_ray.sizing import size_from_target

        size_from_target(cfg, info, kind.sizing(cfg.draft, info))
    return str(target), AutoTokenizer.from_pretrained(target), info


def load_prompts(cfg: Config, tokenizer: Any, which: str | PromptSetConfig) -> list[list[int]]:
    from draft_opd_ray.data.prompts import load_prompt_set

    sub = getattr(cfg.data, which) if isinstance(which, str) else which
    ps = load_prompt_set(
        sub,
        tokenizer,
        chat_template=cfg.data.chat_template,
        system_prompt=cfg.data.system_prompt,
        key=f"data.{which}" if isinstance(which, str) else f"eval set {sub.source}/{sub.split}",
    )
    print(
        f"[data] {which if isinstance(which, str) else sub.split}: {len(ps.prompts)} prompts from {ps.name} (skipped: {ps.skipped or 'none'})",
        flush=True,
    )
    return [list(p.token_ids) for p in ps.prompts]


def opd_prompts(cfg: Config, train: list[list[int]]) -> list[list[int]]:
    """Draft-OPD rolls out on the train prompts after the first `sft.num_prompts`, which are the SFT warm start's
    (whether the sft stage runs now or made `draft.path` earlier): its answers to those are memorised, so their
    on-policy signal says little about new prompts. All of them when none are left."""
    rest = train[cfg.sft.num_prompts :] or train
    rest = random.Random(cfg.seed).sample(
        rest, len(rest)
    )  # a seeded order: seeds differ in what they see first
    print(
        f"[opd] {len(rest)} train prompts after the {cfg.sft.num_prompts} of the SFT warm start (order: seed "
        f"{cfg.seed})",
        flush=True,
    )
    return rest


def initial_draft(cfg: Config, target: str, run_dir: Path) -> str:
    """A draft to start from when no SFT stage ran and no draft.path was given: a fresh one (EAGLE-3 only)."""
    kind = draft_kind(cfg.draft.kind)
    out = run_dir / "draft_init"
    kind.save(kind.fresh(target, cfg.draft, cfg.seed), out, target)
    return str(out)


def opd_stage(
    cfg: Config,
    plan: PlacementPlan,
    target: str,
    draft: str,
    prompts: list[list[int]],
    stop: tuple[int, ...],
    run_dir: Path,
    metrics: MetricsLogger,
    reservation: Reservation | None,
) -> str:
    """The Draft-OPD loop in the run's reservation (Ray is connected by `run`, around every stage); rollouts
    stop at any of ``stop`` (the target's eos ids)."""
    from draft_opd_ray.loop.opd import run_opd

    out = run_opd(cfg, plan, target, draft, prompts, stop, run_dir, metrics, reservation=reservation)
    return str(out)


def eval_stage(
    cfg: Config,
    target: str,
    draft: str | None,
    before: str | None,
    held_out: dict[str, list[list[int]]],
    stop: tuple[int, ...],
    run_dir: Path,
    metrics: MetricsLogger,
    reservation: Reservation | None = None,
) -> None:
    """The evaluation report (τ before/after, acceptance, speed-up, baselines), logged and printed; answers
    stop at any of ``stop`` (the target's eos ids). Its engines run in the reservation's rollout bundle 0 when
    there is one (`slot_call`)."""
    from draft_opd_ray.eval.evaluate import EvalRun, evaluate
    from draft_opd_ray.slot_call import call_in_slot

    run = EvalRun(target, draft, held_out, run_dir / "eval", stop, before=before)
    report = call_in_slot(
        reservation,
        "eval: the engines",
        evaluate,
        run,
        cfg.eval,
        cfg.draft,
        cfg.target,
        cfg.rollout,
        cfg.cluster,
    )
    for name, e in report["datasets"].items():
        metrics.log(
            "eval", 0, dataset=name, tau=e["tau"], tau_vllm=e["tau_vllm"], speedup_c1=e["speedup"].get("1")
        )
    print((run_dir / "eval" / "report.md").read_text(), flush=True)


def ray_session(
    cfg: Config, plan: PlacementPlan, run_dir: Path
) -> AbstractContextManager[Reservation | None]:
    """Ray around the stages that need it: connected, storage checked and the plan reserved before the first
    stage (so a cluster that cannot run the plan fails before any model loads), released after the last."""
    if not set(ray_stages(cfg)) & set(cfg.stages):
        return contextlib.nullcontext()
    from draft_opd_ray.cluster import session

    return session(cfg, plan, run_dir)


@dataclasses.dataclass
class Inputs:
    """What every stage reads: the target, the ids that end its answers (every eos id of its config files and
    tokenizer: `models.target.stop_token_ids`) and the prompt sets, tokenized and filtered (a set that filters
    to nothing is found here, seconds after the cluster is reached and before any stage starts)."""

    target: str
    info: Any
    train: list[Any]
    held_out: dict[str, Any]
    stop: tuple[int, ...]


def prepare_inputs(cfg: Config) -> Inputs:
    """The target (converted once), and the train and held-out prompt sets tokenized and filtered."""
    from draft_opd_ray.models.target import stop_token_ids

    target, tokenizer, info = prepare_target(cfg)
    train = load_prompts(cfg, tokenizer, "train") if {"sft", "opd"} & set(cfg.stages) else []
    held_out = (
        {name: load_prompts(cfg, tokenizer, sub) for name, sub in eval_sets(cfg).items()}
        if "eval" in cfg.stages
        else {}
    )
    return Inputs(target, info, train, held_out, stop_token_ids(info, tokenizer))


def run(cfg: Config, plan: PlacementPlan, run_dir: str) -> None:
    from draft_opd_ray import waits

    waits.configure(cfg.cluster.actor_timeout_s)
    rd = Path(run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    with ray_session(cfg, plan, rd) as reservation:  # an unreachable or too small cluster fails first
        run_stages(cfg, plan, rd, reservation, prepare_inputs(cfg))
    from draft_opd_ray.eval.summary import run_summary

    print(run_summary(rd), flush=True)


def run_stages(
    cfg: Config, plan: PlacementPlan, rd: Path, reservation: Reservation | None, inputs: Inputs | None = None
) -> None:
    x = inputs or prepare_inputs(cfg)
    target, train, held_out, stop = x.target, x.train, x.held_out, x.stop
    metrics = MetricsLogger(
        rd,
        wandb_mode=cfg.wandb.mode,
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        config=dataclasses.asdict(cfg),
    )
    draft = cfg.draft.path
    start_draft: str | None = None  # what the opd stage started from: eval reports τ before and after
    try:
        if "sft" in cfg.stages:
            from draft_opd_ray.sft.stage import run_sft_stage

            draft = str(
                run_sft_stage(
                    cfg,
                    target=target,
                    prompts=train,
                    run_dir=rd,
                    metrics=metrics,
                    reservation=reservation,
                    stop_token_ids=stop,
                )
            )
        if "opd" in cfg.stages:
            start_draft = draft = draft or initial_draft(cfg, target, rd)
            draft = opd_stage(
                cfg, plan, target, draft, opd_prompts(cfg, train), stop, rd, metrics, reservation
            )
        if "eval" in cfg.stages:
            eval_stage(cfg, target, draft, start_draft, held_out, stop, rd, metrics, reservation)
    finally:
        metrics.close()
