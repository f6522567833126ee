"""Preflight: checks a run against its data, models, placement and serving engine before Ray starts or a model
loads (each config node checks its own fields in `config/schema.py`; what spans nodes or touches files is here).

Cheap by construction: reads config.json files, safetensors headers and prompt-file headers, never weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from draft_opd_ray.config.schema import Config, eval_sets
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.placement import PlacementPlan, plan_for
from draft_opd_ray.sizing import Derived, needed_len, size_from_target

if TYPE_CHECKING:
    from draft_opd_ray.models.target import TargetInfo


def _check_draft(cfg: Config) -> None:
    d = cfg.draft
    draft_kind(d.kind).check_config(d)  # an unknown kind first: `draft.kind: must be one of [...]`
    if d.path is not None and not Path(d.path).is_dir():
        raise ConfigError(f"draft.path: directory not found: {d.path}")
    start = cfg.sft.study.start_from
    if "sft" in cfg.stages and start is not None and not Path(start).is_dir():
        raise ConfigError(f"sft.study.start_from: directory not found: {start}")
    if "eval" in cfg.stages and "sft" not in cfg.stages and "opd" not in cfg.stages and d.path is None:
        raise ConfigError(
            "draft.path: stages=[eval] evaluates an existing draft; set draft.path=<draft folder>"
        )


def _check_draft_against_target(cfg: Config) -> None:
    """What the target's config.json can refute (the embedded target's shape is known without converting it):
    draft sizing, lengths, the teacher's top-k, a draft folder the run loads (`_drafts_loaded`) made for another
    target or kind or whose weights are damaged or not the kind's (`DraftKind.check_folder`: safetensors headers
    only), and whether the serving engine can serve this draft kind for the target's architecture."""
    from draft_opd_ray.rollout.support import check_engine_serves

    info = _target_info(cfg)
    kind = draft_kind(cfg.draft.kind)
    kind.check_fits(cfg.draft, info.num_layers, info.vocab_size)
    top = info.max_position_embeddings
    if top is not None and cfg.target.model_len() > top:
        raise ConfigError(
            f"target.max_model_len: {cfg.target.max_model_len} is beyond what the target supports "
            f"(max_position_embeddings {top})"
        )
    vd = kind.vocabulary(cfg.draft, info.vocab_size)
    if cfg.teacher.topk is not None and cfg.teacher.topk > vd:
        raise ConfigError(f"teacher.topk: {cfg.teacher.topk} exceeds the draft vocabulary ({vd} tokens)")
    for key, folder in _drafts_loaded(cfg):
        kind.check_folder(info, folder, key)
    check_engine_serves(cfg.draft.kind, info.architectures, cache_dir(cfg))


def _drafts_loaded(cfg: Config) -> list[tuple[str, str]]:
    """The exported draft folders the run will load, by the config key that names each: `draft.path` (the opd
    stage's start, or what stages=[eval] evaluates), the draft the sft stage continues (`sft.study.start_from`)
    and, for `resume=<run dir>`, the draft of the opd checkpoint the opd stage continues from (an sft checkpoint
    resumes from its DeepSpeed state, not from a draft folder)."""
    from draft_opd_ray.checkpoint import latest_checkpoint

    out = [("draft.path", cfg.draft.path)] if cfg.draft.path is not None else []
    if "sft" in cfg.stages and cfg.sft.study.start_from is not None:
        out.append(("sft.study.start_from", cfg.sft.study.start_from))
    if cfg.resume and "opd" in cfg.stages:
        last = latest_checkpoint(Path(cfg.resume) / "checkpoints" / "opd", "training_state.pt")
        if last is not None:
            out.append(("resume", str(last / "draft")))
    return out


def _target_info(cfg: Config) -> TargetInfo:
    """The target's `TargetInfo` from its config.json (the embedded target's without converting it)."""
    from draft_opd_ray.models.embedded import EMBEDDED_PREFIX, EMBEDDED_TARGET
    from draft_opd_ray.models.target import target_info_for_checks

    path = cfg.target.path
    if path.startswith(EMBEDDED_PREFIX) and path != EMBEDDED_TARGET:
        raise ConfigError(f"target.path: unknown embedded target {path!r}; known: {EMBEDDED_TARGET}")
    if not path.startswith(EMBEDDED_PREFIX) and not Path(path).is_dir():
        raise ConfigError(
            f"target.path: directory not found: {path} (no model hub here; give a local folder)"
        )
    return target_info_for_checks(path, cache_dir(cfg))


def size(cfg: Config) -> list[Derived]:
    """Size the run from the target's files (`sizing.py`): what the config leaves unset is derived and written
    into ``cfg``; returns every sized row for the dry run."""
    info = _target_info(cfg)
    return size_from_target(cfg, info, draft_kind(cfg.draft.kind).sizing(cfg.draft, info))


def cache_dir(cfg: Config) -> Path:
    from draft_opd_ray.cache import default_cache_dir

    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def _check_cache_dir(cfg: Config) -> None:
    """The cache (converted target, answers, features, warm starts) must be writable: found now, not after the
    first stage's work."""
    import tempfile

    root = cache_dir(cfg)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"cache_dir: cannot write to {root} ({e.strerror or e}); set cache_dir=<writable dir>"
        ) from None


def _check_data(cfg: Config) -> None:
    from draft_opd_ray.data.prompts import scan_prompt_file as check_prompt_source

    if "sft" in cfg.stages or "opd" in cfg.stages:
        check_prompt_source(cfg.data.train, key="data.train")
    if "eval" in cfg.stages:
        for name, sub in eval_sets(cfg).items():
            check_prompt_source(sub, key="data.eval" if sub is cfg.data.eval else f"eval.extra_sets ({name})")


def _check_lengths(cfg: Config) -> None:
    need, why = needed_len(cfg)
    if need > cfg.target.model_len():
        raise ConfigError(
            f"target.max_model_len: {cfg.target.max_model_len} is shorter than the run's longest sequence ({why}); "
            "raise target.max_model_len (or leave it unset: sized from the run) or lower data.*.max_prompt_tokens"
        )


def _check_training(cfg: Config) -> None:
    """What the sft/opd stages can run today, refused before anything loads."""
    if "opd" not in cfg.stages:
        return
    if not draft_kind(cfg.draft.kind).starts_fresh and cfg.draft.path is None and "sft" not in cfg.stages:
        raise ConfigError(
            f"draft.path: the opd stage post-trains an existing {cfg.draft.kind} draft; give its folder "
            "(only an eagle3 head can start from scratch)"
        )
    if cfg.loss.objective != "sft_on_rollouts" and (cfg.loss.estimator == "topk") != (
        cfg.teacher.topk is not None
    ):
        raise ConfigError(
            f"loss.estimator: {cfg.loss.estimator} with teacher.topk={cfg.teacher.topk}: the topk estimator "
            "needs a teacher top-k (teacher.topk=16), full and token need the whole distribution (teacher.topk=null)"
        )
    if cfg.rollout.max_new_tokens < 2:
        raise ConfigError(
            f"rollout.max_new_tokens: the opd stage needs >= 2 (the first token comes from the prefill, the "
            f"drafted blocks after it), got {cfg.rollout.max_new_tokens}"
        )
    if cfg.anchor.policy == "random" and cfg.replay.mode == "recorded":
        raise ConfigError(
            "anchor.policy: random anchors fall between recorded blocks, so recorded replay has nothing to "
            "score there; use error or all (random needs replay.mode=redraft)"
        )


def _check_zero(cfg: Config) -> None:
    """ZeRO-3 partitions the draft's weights, but the learner reads them whole outside the forward (the LM head in
    the loss, `rollout_state` for the weight sync); the SFT arm shares the engine settings."""
    if cfg.learner.zero_stage == 3 and ("sft" in cfg.stages or "opd" in cfg.stages):
        raise ConfigError(
            "learner.zero_stage: 3 is not supported (the learner reads whole weights); use 0, 1 or 2"
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


def _check_wandb(cfg: Config) -> None:
    """`wandb.mode=online` needs an API key (W&B would otherwise stop to ask for one, or fail, at the first
    stage); the key is never written to the config or the logs."""
    import os

    if cfg.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace"):
        return
    raise ConfigError(
        "wandb.mode: online needs a W&B API key (set WANDB_API_KEY or run `wandb login`); "
        "or keep wandb.mode=offline and `wandb sync` the run dir later"
    )


def check_resumable(resume_dir: Path, run_dir: Path) -> None:
    """`resume=<run dir>`: Hydra's run dir is that dir (`conf/config.yaml`), and it holds a complete checkpoint
    of a training stage; resuming a run with nothing to resume is an error, not a fresh start."""
    from draft_opd_ray.checkpoint import latest_checkpoint

    if resume_dir.resolve() != run_dir.resolve():
        raise ConfigError(
            f"resume: the run would write to {run_dir}, not to {resume_dir}; drop the hydra.run.dir override"
        )
    found = [
        s
        for s, marker in (("sft", "training_state.pt"), ("opd", "training_state.pt"))
        if latest_checkpoint(resume_dir / "checkpoints" / s, marker) is not None
    ]
    if not found:
        raise ConfigError(
            f"resume: nothing to resume in {resume_dir}: no complete checkpoint under checkpoints/sft or "
            "checkpoints/opd (start a new run without resume)"
        )


def validate(cfg: Config) -> PlacementPlan:
    """All cross-node checks; returns the placement plan (itself a check that the actors fit)."""
    _check_cluster(cfg)
    _check_wandb(cfg)
    _check_draft(cfg)
    if cfg.target.max_model_len is None:  # main sized it already, to print the rows
        size(cfg)
    _check_zero(cfg)
    _check_training(cfg)
    _check_lengths(cfg)
    _check_data(cfg)
    _check_cache_dir(cfg)
    _check_draft_against_target(cfg)
    plan = plan_for(cfg)
    if "opd" in cfg.stages:  # the weight transport the placement allows (NCCL: no GPU shared with the sender)
        from draft_opd_ray.sync.nccl import plan_weight_sync

        plan_weight_sync(cfg.rollout.weight_sync, plan)
    return plan
