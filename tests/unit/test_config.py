"""Config composition and validation: bad values fail fast with one line naming the key, exit code != 0."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from pathlib import Path

import pytest

from draft_opd_ray.config.schema import Config
from draft_opd_ray.config.store import compose
from draft_opd_ray.drafts.registry import draft_kind
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.preflight import validate
from tests import helpers


def run_main(*overrides: str) -> subprocess.CompletedProcess[str]:
    return helpers.run_main(*overrides, HYDRA_FULL_ERROR="0")


def test_defaults_compose_to_the_paper_defaults() -> None:
    cfg = compose()
    assert cfg.loss.gamma == 0.8 and cfg.loss.lambda_acc == 1.0 and cfg.loss.lambda_rej == 1.0
    assert cfg.loss.rejected_scope == "all" and cfg.anchor.policy == "error"
    assert cfg.optim.lr == 1e-4 and cfg.optim.warmup_ratio == 0.05  # OPD continues at the end of SFT
    assert cfg.rollout.temperature == 0.0
    assert cfg.draft.kind == "eagle3" and cfg.draft.num_speculative_tokens == 4
    assert cfg.stages == ["sft", "opd", "eval"] and cfg.opd.steps == 15 and cfg.opd.rounds_per_step is None
    assert cfg.cluster.name == "local" and cfg.cluster.gpus_per_node == 0
    assert cfg.draft.aux_layer_ids is None  # derived from the target: (2, L/2, L-1)
    assert cfg.draft.draft_vocab_size is None and cfg.draft.ttt_steps == 4  # from the target: at most 8,192
    assert cfg.draft.vocab_for(49152) == 8192 and cfg.draft.vocab_for(4096) == 4096
    assert cfg.data.train.max_prompts == 2560 and cfg.sft.num_prompts == 768
    assert cfg.sft.trajectory_dtype == "auto" and cfg.sft.batch_tokens == 512  # auto: bfloat16 where fast
    assert cfg.sft.train_tokens == 160_000 and cfg.sft.study.time_budget_min is None  # tokens; minutes a cap


def test_defaults_are_written_once() -> None:
    """The dataclass defaults are the composed default config: the YAML adds nothing of its own."""
    assert dataclasses.asdict(Config()) == dataclasses.asdict(compose([]))


def test_async_is_spelled_async_on_the_command_line() -> None:
    cfg = compose(["async.max_staleness=5", "loss.gamma=0.6", "anchor.policy=random"])
    assert cfg.async_.max_staleness == 5 and cfg.loss.gamma == 0.6 and cfg.anchor.policy == "random"


def test_cluster_group_overrides_learner_and_target() -> None:
    cfg = compose(["+cluster=2x8xH100"])
    assert cfg.cluster.num_nodes == 2 and cfg.learner.zero_stage == 2 and cfg.target.dtype == "bfloat16"


def test_draft_groups() -> None:
    d = compose(["draft=dflash"]).draft
    assert d.kind == "dflash" and d.num_speculative_tokens == d.block_size - 1
    assert compose(["draft=standalone"]).draft.kind == "standalone"


def test_algorithm_ablations() -> None:
    assert compose(["algorithm=sft_on_rollouts"]).loss.objective == "sft_on_rollouts"
    assert compose(["algorithm=forward_kl"]).loss.directions == "forward"
    assert compose(["algorithm=reverse_kl"]).loss.directions == "reverse"


def test_valid_config_validates_and_places() -> None:
    plan = validate(compose())
    assert len(plan.of("rollout")) == 2 and len(plan.of("replay")) == 1 and len(plan.of("learner")) == 1


def test_good_dry_run_exits_zero_fast() -> None:
    t0 = time.monotonic()
    r = run_main("+cluster=8xA100", "dry_run=true")
    assert r.returncode == 0, r.stderr
    assert "placement plan for cluster '8xA100'" in r.stdout
    assert time.monotonic() - t0 < 30


# The bad-input matrix (every user error: one line, exit code 2, no run dir): tests/integration/test_bad_input.py


@pytest.mark.parametrize(
    "override,message",
    [
        ("draft.ttt_steps=0", "draft.ttt_steps: must be >= 1, got 0"),
        ("draft.ttt_decay=0", "draft.ttt_decay: must be in (0, 1], got 0.0"),
        ("draft.aux_layer_ids=[]", "draft.aux_layer_ids: must list at least one layer"),
    ],
)
def test_draft_training_time_test_fields_are_checked(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose([override])


def test_validate_raises_config_error_in_process() -> None:
    with pytest.raises(ConfigError, match="cluster: the actors need"):
        validate(compose(["+cluster=8xA100", "cluster.learner_ranks=5"]))


def test_zero_stage_3_is_refused_for_the_training_stages() -> None:
    """ZeRO-3 partitions the weights the learner reads whole (LM head, refit): refused before anything loads,
    for the sft and opd stages alike (they share `learner.zero_stage`)."""
    for stages in ("[sft]", "[opd]"):
        with pytest.raises(ConfigError, match=re.escape("learner.zero_stage: 3 is not supported")):
            validate(compose(["learner.zero_stage=3", f"stages={stages}"]))


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (
            ["draft.aux_layer_ids=[2,15,30]"],
            "draft.aux_layer_ids: [30] out of range for a target with 30 layers",
        ),
        (
            ["draft.draft_vocab_size=50000"],
            "draft.draft_vocab_size: 50000 exceeds the target vocabulary 49152",
        ),
        (["draft=standalone", "draft.num_layers=30"], "draft.num_layers: a standalone draft made of target"),
        (["draft=dflash", "draft.mask_token_id=49152"], "draft.mask_token_id: 49152 is outside the target"),
    ],
)
def test_draft_that_does_not_fit_the_target_is_rejected(overrides: list[str], fragment: str) -> None:
    """Checked against the target's config (SmolLM2: 30 layers, vocabulary 49,152) before any model loads."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        d = compose(overrides).draft
        draft_kind(d.kind).check_fits(d, num_layers=30, vocab_size=49152)


def test_default_draft_fits_the_default_target() -> None:
    for kind in ("eagle3", "standalone", "dflash"):
        d = compose([f"draft={kind}"]).draft
        draft_kind(kind).check_fits(d, num_layers=30, vocab_size=49152)


def test_eval_of_a_draft_of_another_target_is_one_line_exit_2(tmp_path: Path, tiny_target: Path) -> None:
    """An EAGLE-3 head made for the tiny target, evaluated on the embedded SmolLM2 target: refused from the two
    config.json files, before any engine starts."""
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    draft = save_eagle3(init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2]), tmp_path / "d", tiny_target)
    r = run_main("stages=[eval]", f"draft.path={draft}")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().count("\n") == 0 and "a draft of another target" in r.stderr, r.stderr
    r = run_main("stages=[eval]", "draft=standalone", f"draft.path={draft}")
    assert r.returncode == 2 and "holds a draft of kind 'eagle3', but draft.kind=standalone" in r.stderr, (
        r.stderr
    )


def test_empty_eval_prompt_set_is_one_line_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "eval.jsonl"
    empty.write_text("")
    d = tmp_path / "draft"
    d.mkdir()
    r = run_main("stages=[eval]", f"draft.path={d}", "data.eval.source=jsonl", f"data.eval.path={empty}")
    assert r.returncode == 2 and r.stderr.startswith("error: data.eval.path: file is empty"), r.stderr


def test_a_sweep_jobs_dir_name_is_one_short_path_component() -> None:
    """`hydra.sweep.subdir` goes through `job_slug`: an override holding a path does not nest the job's dir,
    and a long sweep's name is cut with a hash that tells two long sweeps apart."""
    from draft_opd_ray.config.store import SLUG_MAX, job_slug

    assert job_slug("loss.gamma=0.9,seed=1") == "loss.gamma=0.9,seed=1"
    assert job_slug("draft.aux_layer_ids=[0,1,2]") == "draft.aux_layer_ids=[0,1,2]"
    slug = job_slug("target.path=/models/Qwen3-8B,seed=0")
    assert "/" not in slug and slug.startswith("target.path=_models_Qwen3-8B")
    a, b = job_slug("x=" + "a" * 300 + ",seed=0"), job_slug("x=" + "a" * 300 + ",seed=1")
    assert len(a) == len(b) == SLUG_MAX and a != b


def test_every_override_key_is_checked_against_the_schema_before_hydra() -> None:
    """`+key=value` and `++key=value` are added by Hydra without a check: ours refuses any key the schema lacks
    and names the nearest one; flags, Hydra's keys, config groups and list elements pass."""
    from draft_opd_ray.config.store import override_key_error

    assert override_key_error(["+loss.gama=0.5"]) == "loss.gama: not a config key; did you mean loss.gamma?"
    assert override_key_error(["++los.gamma=0.5"]) == "los.gamma: not a config key; did you mean loss.gamma?"
    assert (
        override_key_error(["~teacher.sorce"])
        == "teacher.sorce: not a config key; did you mean teacher.source?"
    )
    assert override_key_error(["x.y=1"]) == "x.y: not a config key (every key: --cfg job)"
    fine = [
        "-m",
        "--cfg",
        "job",
        "loss.gamma=0.6,0.8",
        "draft=standalone",
        "+cluster=8xA100",
        "hydra.run.dir=x",
        "hydra/launcher=basic",
        "async.max_staleness=3",
        "eval.concurrency=[1,4]",
        "draft.aux_layer_ids.0=3",
        "teacher.source=replay",
        "~wandb.mode",
        "data.train.path=a.jsonl",
        "cluster.rollout_engines=2",
    ]
    assert override_key_error(fine) is None


def test_a_multirun_dry_run_leaves_no_file(tmp_path: Path) -> None:
    """Each job of a dry-run sweep prints its plan and removes its own dir; the sweep dir, where Hydra wrote
    multirun.yaml at start, goes with the last one."""
    sweep = tmp_path / "multirun" / "day" / "time"
    r = run_main("-m", "loss.gamma=0.6,0.9", "dry_run=true", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("placement plan for cluster") == 2
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], list(tmp_path.rglob("*"))
