"""Checks that span several config nodes or touch the file system. Run before Ray starts or a model loads.

Cheap by construction: reads config.json files and prompt-file headers, never weights.
"""

from __future__ import annotations

from pathlib import Path

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.models import kinds
from draft_opd_ray.placement import PlacementPlan, build_plan


def plan_for(cfg: Config) -> PlacementPlan:
    return build_plan(cfg.cluster, draft_kind=cfg.draft.kind, zero_stage=cfg.learner.zero_stage)


def _check_draft(cfg: Config) -> None:
    d = cfg.draft
    kinds.check_draft_config(d)
    if d.path is not None and not Path(d.path).is_dir():
        raise ConfigError(f"draft.path: directory not found: {d.path}")
    if "eval" in cfg.stages and "sft" not in cfg.stages and "opd" not in cfg.stages and d.path is None:
        raise ConfigError(
            "draft.path: stages=[eval] evaluates an existing draft; set draft.path=<draft folder>"
        )


def _check_draft_against_target(cfg: Config) -> None:
    """Layer ids and sizes that the target's config.json can already refute."""
    from draft_opd_ray.models.target import read_target_info, resolve_target_path

    if not cfg.target.path.startswith("embedded:") and not Path(cfg.target.path).is_dir():
        raise ConfigError(
            f"target.path: directory not found: {cfg.target.path} (no model hub here; give a local folder)"
        )
    if cfg.target.path.startswith("embedded:"):
        from draft_opd_ray.models.target import EMBEDDED_TARGET

        if cfg.target.path != EMBEDDED_TARGET:
            raise ConfigError(
                f"target.path: unknown embedded target {cfg.target.path!r}; known: {EMBEDDED_TARGET}"
            )
        return  # converted lazily on first use; its shape is known: checked again after conversion
    info = read_target_info(resolve_target_path(cfg.target.path))
    kinds.check_draft_fits_target(cfg.draft, info.num_layers, info.vocab_size)


def _check_data(cfg: Config) -> None:
    from draft_opd_ray.data.prompts import check_prompt_source

    if "sft" in cfg.stages or "opd" in cfg.stages:
        check_prompt_source(cfg.data.train, key="data.train")
    if "eval" in cfg.stages:
        from draft_opd_ray.driver import eval_sets

        for name, sub in eval_sets(cfg).items():
            check_prompt_source(sub, key="data.eval" if sub is cfg.data.eval else f"eval.extra_sets ({name})")


def _check_lengths(cfg: Config) -> None:
    longest = max(cfg.data.train.max_prompt_tokens, cfg.data.eval.max_prompt_tokens)
    gen = max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens, cfg.sft.max_new_tokens)
    if longest + gen + cfg.draft.num_speculative_tokens + 1 > cfg.target.max_model_len:
        raise ConfigError(
            f"target.max_model_len: {cfg.target.max_model_len} is shorter than the longest prompt ({longest}) + "
            f"new tokens ({gen}) + K + 1; raise target.max_model_len or lower data.*.max_prompt_tokens"
        )


def _check_training(cfg: Config) -> None:
    """What the sft/opd stages can run today, refused before anything loads."""
    if "opd" not in cfg.stages:
        return
    if (
        not kinds.draft_kind(cfg.draft.kind).starts_fresh
        and cfg.draft.path is None
        and "sft" not in cfg.stages
    ):
        raise ConfigError(
            f"draft.path: the opd stage post-trains an existing {cfg.draft.kind} draft; give its folder "
            "(only an eagle3 head can start from scratch)"
        )
    if cfg.loss.objective == "opd" and (cfg.loss.estimator == "topk") != (cfg.teacher.topk is not None):
        raise ConfigError(
            f"loss.estimator: {cfg.loss.estimator} with teacher.topk={cfg.teacher.topk}: the topk estimator "
            "needs a teacher top-k (teacher.topk=16), full and token need the whole distribution (teacher.topk=null)"
        )
    if cfg.anchor.policy == "random" and cfg.replay.mode == "recorded":
        raise ConfigError(
            "anchor.policy: random anchors fall between recorded blocks, so recorded replay has nothing to "
            "score there; use error or all (random needs replay.mode=redraft)"
        )


def _check_cluster(cfg: Config) -> None:
    c = cfg.cluster
    if c.num_nodes > 1 and c.storage_dir is None:
        raise ConfigError(
            f"cluster.storage_dir: a {c.num_nodes}-node cluster needs a directory every node mounts at the same "
            "path (run dir, cache, checkpoints); set cluster.storage_dir=/shared/path"
        )


def check_run_dir(cfg: Config, run_dir: str | Path) -> None:
    """With `cluster.storage_dir`, the run dir must be under it: the actors on other nodes write there. The
    multi-node cluster groups put Hydra's run and sweep dirs under it; an explicit `hydra.run.dir` elsewhere
    is refused rather than moved (Hydra has already written its config there)."""
    store = cfg.cluster.storage_dir
    if store is None:
        return
    rd, root = Path(run_dir).resolve(), Path(store).resolve()
    if rd != root and root not in rd.parents:
        raise ConfigError(
            f"hydra.run.dir: {run_dir} is not under cluster.storage_dir ({store}), so the other nodes cannot "
            f"see it; set hydra.run.dir={store}/<name>"
        )


def validate(cfg: Config) -> PlacementPlan:
    """All cross-node checks; returns the placement plan (itself a check that the actors fit)."""
    _check_cluster(cfg)
    _check_draft(cfg)
    _check_training(cfg)
    _check_lengths(cfg)
    _check_draft_against_target(cfg)
    _check_data(cfg)
    return plan_for(cfg)
