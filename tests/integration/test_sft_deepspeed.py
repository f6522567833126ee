"""`run_sft` through a real DeepSpeed engine on the tiny target: training lowers the loss on a repeated batch,
checkpoints are atomic and resume where they stopped (weights, optimizer state, FLOPs); the standalone
(distillation) and DFlash (random-anchor block loss) recipes train through the same loop and export folders their
loaders read back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, OptimConfig, SFTConfig, SFTStudyConfig
from draft_opd_ray.drafts.eagle3.model import load_eagle3
from draft_opd_ray.sft.trainer import SFTJob, run_sft

pytestmark = pytest.mark.deepspeed


def _run(
    target: Path, traj: Path, run_dir: Path, steps: int, draft: DraftConfig, resume: bool = False
) -> tuple[Path, list[dict]]:
    rec: list[dict] = []
    job = SFTJob(
        sft=SFTConfig(
            epochs=50, train_tokens=None, batch_tokens=4096, lr=3e-3, study=SFTStudyConfig(time_budget_min=5)
        ),
        draft=draft,
        optim=OptimConfig(warmup_ratio=0.0, schedule="constant"),
        learner=LearnerConfig(zero_stage=0, dtype="float32"),
        cache_dir=run_dir.parent / "cache",
        max_steps=steps,
        resume=resume,
    )
    out = run_sft(job, target, traj, run_dir, metrics=rec.append, progress=False)
    return out, rec


def test_deepspeed_sft_lowers_loss_and_resumes(tiny_target: Path, trajectories: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    draft = DraftConfig(draft_vocab_size=256, ttt_steps=3)
    out, rec = _run(tiny_target, trajectories, run_dir, 3, draft)
    losses = [r["loss"] for r in rec if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {"acc_0", "acc_2", "tokens_per_s", "flops_draft", "flops_target"} <= set(rec[0])
    root = run_dir / "checkpoints" / "sft"
    assert os.readlink(root / "latest") == "step_3" and out == root / "step_3" / "draft"
    assert not list(root.glob(".tmp-*"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 256
    saved = load_eagle3(out, tiny_target)
    # resume: continues from step 3 with the saved weights and optimizer state
    out2, rec2 = _run(tiny_target, trajectories, run_dir, 5, draft, resume=True)
    steps = [r["step"] for r in rec2 if "loss" in r]
    assert steps == [4, 5] and os.readlink(root / "latest") == "step_5"
    assert rec2[0]["loss"] < losses[0]  # not a fresh start
    assert rec2[0]["flops_draft"] > rec[-2]["flops_draft"]  # FLOPs carried over
    resumed = load_eagle3(out2, tiny_target)
    assert not torch.equal(saved.fc.weight, resumed.fc.weight)


@pytest.mark.parametrize("kind", ["standalone", "dflash"])
def test_other_kinds_train_through_the_same_loop(
    tiny_target: Path, trajectories: Path, tmp_path: Path, kind: str
) -> None:
    from draft_opd_ray.drafts.dflash.model import load_dflash
    from draft_opd_ray.drafts.standalone.model import load_standalone

    draft = DraftConfig(kind=kind, num_layers=2, block_size=5, num_speculative_tokens=4)
    out, rec = _run(tiny_target, trajectories, tmp_path / kind, 4, draft)
    losses = [r["loss"] for r in rec if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(r["flops_draft"] > 0 for r in rec if "loss" in r)
    if kind == "standalone":
        lm = load_standalone(out, tiny_target)
        assert lm.config.num_hidden_layers == 2
    else:
        assert load_dflash(out, tiny_target).config.block_size == 5


@pytest.mark.parametrize("feature_mode", ["cache", "on_the_fly"])
def test_a_continued_draft_pays_each_answers_target_forward_once(
    tiny_target: Path, trajectories: Path, tmp_path: Path, feature_mode: str
) -> None:
    """SFT continued from a draft (the matched-FLOPs `sft` arm) on cached features is charged each answer's target
    forward once, in the epoch that first uses it, as the replay and the no-replay controls are; on the fly the
    target runs again every epoch and is charged every epoch. The charge is the feature pass's: the decoder over
    the padded batch, the LM head on the loss rows."""
    from draft_opd_ray.flops import feature_pass_flops
    from draft_opd_ray.models.target import read_target_info

    draft = DraftConfig(draft_vocab_size=256, ttt_steps=2)
    start, _ = _run(tiny_target, trajectories, tmp_path / "warm", 1, draft)
    rec: list[dict] = []
    job = SFTJob(
        sft=SFTConfig(
            epochs=3,
            train_tokens=None,
            batch_tokens=4096,
            lr=1e-3,
            study=SFTStudyConfig(start_from=str(start)),
        ),
        draft=draft,
        optim=OptimConfig(warmup_ratio=0.0, schedule="constant"),
        learner=LearnerConfig(zero_stage=0, dtype="float32"),
        cache_dir=tmp_path / "cache",
        feature_mode=feature_mode,
    )
    run_sft(job, tiny_target, trajectories, tmp_path / "continued", metrics=rec.append, progress=False)
    rows = [r for r in rec if "loss" in r]
    assert [r["epoch"] for r in rows] == [0, 1, 2]  # the two 32-token answers make one batch an epoch
    once = feature_pass_flops(read_target_info(tiny_target), 2, 32, 2 * (24 + 1))  # rows from prompt_len - 1
    charged = [r["flops_target"] for r in rows]
    want = [once, once, once] if feature_mode == "cache" else [once, 2 * once, 3 * once]
    assert charged == pytest.approx(want)


def test_the_flops_budget_schedule_runs_over_the_updates_it_allows(
    tiny_target: Path, trajectories: Path, tmp_path: Path
) -> None:
    """With `sft.study.max_flops` the lr schedule runs over the updates the budget allows, counted ahead from each
    batch's FLOPs (`planned_steps`), not over the FLOPs fraction: the first epoch, which also pays the answers'
    feature forward, does not spend the schedule faster than the epochs after it."""
    from draft_opd_ray.optim import lr_factor

    draft = DraftConfig(draft_vocab_size=256, ttt_steps=2)
    start, _ = _run(tiny_target, trajectories, tmp_path / "warm", 1, draft)

    def continued(name: str, max_flops: float | None) -> list[dict]:
        rec: list[dict] = []
        study = SFTStudyConfig(start_from=str(start), max_flops=max_flops)
        job = SFTJob(
            sft=SFTConfig(epochs=4, train_tokens=None, batch_tokens=4096, lr=1e-3, study=study),
            draft=draft,
            optim=OptimConfig(warmup_ratio=0.0, schedule="cosine"),
            learner=LearnerConfig(zero_stage=0, dtype="float32"),
            cache_dir=tmp_path / "cache",
        )
        run_sft(job, tiny_target, trajectories, tmp_path / name, metrics=rec.append, progress=False)
        return [r for r in rec if "loss" in r]

    free = continued("free", None)  # 4 epochs of one batch: the FLOPs each step ends at
    spent = [r["flops_draft"] + r["flops_target"] for r in free]
    assert (
        spent[0] > spent[1] - spent[0] == pytest.approx(spent[2] - spent[1])
    )  # epoch 0 pays the features too
    rows = continued("budget", spent[2])  # the budget of 3 steps
    assert len(rows) == 3
    state = torch.load(tmp_path / "budget" / "checkpoints" / "sft" / "step_3" / "training_state.pt")
    assert state["planned_steps"] == 3
    assert [r["lr"] for r in rows] == pytest.approx(
        [1e-3 * lr_factor(i / 3, 0.0, "cosine") for i in range(3)]
    )
