"""End to end on real vLLM, Ray and DeepSpeed with a tiny target: the Draft-OPD loop writes metrics, anchor
Parquet files and atomic checkpoints, and a second run with resume=<run dir> continues from the last checkpoint.
Slow (two runs, several vLLM engines): `make test-slow`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from draft_opd_ray.metrics import read_metrics
from draft_opd_ray.rollout.records import read_parquet
from draft_opd_ray.wire import consistency_error
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray, pytest.mark.deepspeed]


def run_main(run_dir: Path, target: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """The opd stage alone on the tiny target (its chat template is the embedded target's), from the repo root."""
    return helpers.run_main(
        "stages=[opd]",
        f"target.path={target}",
        "rollout.prompts_per_round=4",
        "rollout.max_new_tokens=24",
        "data.train.max_prompts=16",
        "draft.aux_layer_ids=[0,1,2]",
        "wandb.mode=disabled",
        "opd.checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
        *overrides,
        timeout=1500,
    )


def test_opd_loop_runs_and_resumes(tiny_target: Path, tmp_path: Path) -> None:
    target = tiny_target
    run_dir = tmp_path / "run"
    r = run_main(run_dir, target, "opd.steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == [1, 2] and all(m["loss"] > 0 for m in rows)
    assert [m["policy_version"] for m in rows] == [1, 2]
    assert os.readlink(run_dir / "checkpoints" / "opd" / "latest") == "step_2"
    assert (run_dir / "checkpoints" / "opd" / "step_2" / "draft" / "config.json").is_file()
    recs = read_parquet(run_dir / "anchors" / "step_00000.parquet")
    assert recs and all(consistency_error(x) is None for x in recs)

    r = run_main(run_dir, target, "opd.steps=3", f"resume={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == [1, 2, 3]  # continued at step 3, did not redo 1-2
    # step 3 takes the round that was in flight at the checkpoint (drawn by version 1, as without the stop), and the
    # workers resumed at version 2 (not 0: then every round would look 2 versions stale and be dropped)
    assert rows[-1]["staleness"] == 1 and rows[-1]["dropped_stale"] == 0
    assert rows[-1]["policy_version"] == 3
    assert os.readlink(run_dir / "checkpoints" / "opd" / "latest") == "step_3"
    # the default teacher is the verification pass's, also for the round the checkpoint held in flight, and the
    # EAGLE-3 features came with it: the replay ran no target forward (training FLOPs count none)
    assert all(m["teacher_captured"] == 1.0 and m["flops_target"] == 0 for m in rows)


def test_opd_loop_post_trains_a_standalone_draft_with_redraft(tiny_target: Path, tmp_path: Path) -> None:
    """The same loop with a standalone LM draft served by vLLM's `draft_model`, every block start as an anchor
    and replay.mode=redraft (the replay actor receives every published version and redrafts with it), two
    optimizer updates per step: the exported draft loads back as a causal LM on the target's vocabulary.
    (Random anchors are budget-matched to the error anchors, and this tiny random target's greedy output is
    often accepted whole by a slice of itself, so they can be none.)"""
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target, load_standalone

    target = tiny_target
    draft = build_standalone_from_target(target, tmp_path / "draft", num_layers=1)
    run_dir = tmp_path / "run"
    r = run_main(
        run_dir,
        target,
        "draft=standalone",
        f"draft.path={draft}",
        "replay.mode=redraft",
        "anchor.policy=all",
        "learner.mini_batches=2",
        "opd.steps=2",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == [1, 2] and all(m["loss"] > 0 for m in rows)
    assert all(m["updates"] == 2 for m in rows) and [m["policy_version"] for m in rows] == [1, 2]
    out = run_dir / "checkpoints" / "opd" / "step_2" / "draft"
    load_standalone(out, target)


def test_the_soft_label_control_trains_epochs_passes_over_each_step(
    tiny_target: Path, tmp_path: Path
) -> None:
    """`algorithm=sft_on_rollouts_soft` with `learner.epochs=2`: the replay scores the committed continuations with
    the teacher (no drafted block), the learner takes 2 x mini_batches updates a step, and the step's draft FLOPs
    are twice one pass's (the same batch twice)."""
    run_dir = tmp_path / "run"
    r = run_main(
        run_dir,
        tiny_target,
        "algorithm=sft_on_rollouts_soft",
        "learner.mini_batches=2",
        "learner.epochs=2",
        "opd.steps=1",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert row["updates"] == 4 and row["loss"] > 0
    assert row["flops_draft"] > 0 and row["flops_target"] > 0
