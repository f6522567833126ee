"""The SFT stage on 2 learner ranks (Ray actors in a placement group, one DeepSpeed data-parallel group over
gloo) trains the same draft as in-process on one rank: the same batches and schedule, the same metrics rows
(form and values) and the same files (warm start folder, checkpoints). The answers come from the trajectory
cache, filled here (vLLM's generation has its own tests).

Data: 6 answers of different lengths in batches of 3, 2 and 1 sequences (uneven shares, and a rank with no
sequence of its own), 2 epochs = 6 steps.

Tolerance (float32). Two ranks add their gradients and their loss sums in another order than one rank does, so
every metric reduced over the batch (losses, accuracies, the gradient norm: `REDUCED`) can differ in its last
bits: float32 rounds at 6e-8 relative and 6 steps of training compound it, so those compare at rel 1e-5 (on a
2-core AVX2-only CPU the step-1 gradient norm differed by 1 ulp, 0.6414687037 against 0.6414687634, and the
largest relative difference over the 6 steps was 1.8e-7: the test prints it with -s). Counts, the step, the
epoch and the learning rate (the same arithmetic on both layouts) compare exactly. Weights within 5e-6 (6 AdamW
steps of lr 3e-3 move a weight by up to ~2e-2; AdamW divides by the root of the squared gradients, so a near-zero
gradient component can differ by more than rounding: measured max 2.1e-6 on a CPU with AVX512/AMX kernels, under
2e-6 on AVX2).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.config.schema import (
    ClusterConfig,
    Config,
    DraftConfig,
    LearnerConfig,
    OptimConfig,
    SFTConfig,
    TeacherConfig,
)
from draft_opd_ray.metrics import MetricsLogger, read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.deepspeed]

RESPONSES = (40, 36, 30, 24, 20, 12)  # answer lengths; prompts have 8 tokens
TIMING = {"time", "tokens_per_s", "padded_tokens_per_s", "budget_min", "feature_s", "train_s"}
REDUCED = (
    "loss",
    "acc",
    "grad_norm",
)  # metrics summed over the batch in a layout's own order (module docstring)
REDUCED_RTOL = 1e-5


class Bundles:
    """``n`` learner bundles and rollout bundle 0 (where the stage's answers are made: `slot_call`) of a real
    placement group, the way the run's reservation hands them out."""

    def __init__(self, n: int) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.n = n
        self.pg = placement_group([{"CPU": 0.5}] * (n + 1), strategy="PACK")
        ray.get(self.pg.ready())

    def options(self, role: str, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert (role, index) == ("rollout", 0) or (role == "learner" and index < self.n)
        bundle = self.n if role == "rollout" else index
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        return {"num_cpus": 0.5, "scheduling_strategy": strategy}


def _config(tmp: Path, target: Path, ranks: int) -> Config:
    return dataclasses.replace(
        Config(),
        cache_dir=str(tmp / "cache"),
        cluster=ClusterConfig(learner_ranks=ranks),
        draft=DraftConfig(draft_vocab_size=256, ttt_steps=3),
        sft=SFTConfig(
            num_prompts=len(RESPONSES),
            max_new_tokens=64,
            trajectory_dtype="float32",
            train_tokens=None,
            epochs=2,
            batch_tokens=100,
            lr=3e-3,
        ),
        optim=OptimConfig(warmup_ratio=0.0, schedule="constant"),
        learner=LearnerConfig(zero_stage=0, dtype="float32", backend="gloo"),
        # float32 everywhere: `auto` is bfloat16 on an AVX512-BF16/AMX CPU
        teacher=TeacherConfig(dtype="float32"),
    )


def _prompts_with_cached_answers(cfg: Config, target: Path) -> list[list[int]]:
    """Prompts whose answers sit in the trajectory cache where the stage looks for them."""
    from draft_opd_ray.models.target import target_stop_token_ids
    from draft_opd_ray.sft.data import FINAL, Trajectory, _write, cache_key

    g = torch.Generator().manual_seed(0)
    rows = [
        Trajectory(
            torch.randint(3, 300, (8,), generator=g).tolist(),
            torch.randint(3, 300, (n,), generator=g).tolist(),
        )
        for n in RESPONSES
    ]
    prompts = [r.prompt_ids for r in rows]
    key = cache_key(target, prompts, cfg.sft.max_new_tokens, target_stop_token_ids(target), "float32")
    folder = Path(cfg.cache_dir or "") / "sft_trajectories" / key
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / FINAL, rows)
    return prompts


def _stage(tmp: Path, target: Path, ranks: int | None) -> tuple[Path, list[dict[str, Any]], Path]:
    """(final draft, metrics rows, warm start folder) of the sft stage: in-process (None) or on ``ranks``."""
    from draft_opd_ray.sft.stage import run_sft_stage

    cfg = _config(tmp, target, ranks or 1)
    prompts = _prompts_with_cached_answers(cfg, target)
    metrics = MetricsLogger(tmp / "run", wandb_mode="disabled")
    draft = run_sft_stage(
        cfg,
        target=str(target),
        prompts=prompts,
        run_dir=tmp / "run",
        metrics=metrics,
        reservation=Bundles(ranks) if ranks else None,
    )
    metrics.close()
    warm = next((tmp / "cache" / "warm_starts").glob("*/draft"))
    return draft, read_metrics(tmp / "run" / "metrics.jsonl"), warm


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_two_ranks_train_the_draft_one_rank_does(ray_local: None, tiny_target: Path, tmp_path: Path) -> None:
    one, rows1, warm1 = _stage(tmp_path / "one", tiny_target, None)
    two, rows2, warm2 = _stage(tmp_path / "two", tiny_target, 2)

    # the same files: final draft, checkpoints (DeepSpeed state included), warm start
    assert one.relative_to(tmp_path / "one") == two.relative_to(tmp_path / "two")
    assert _files(tmp_path / "one" / "run") == _files(tmp_path / "two" / "run")
    assert _files(warm1) == _files(warm2) and (warm2 / "config.json").is_file()

    # the same rows: 6 steps and the closing row, the same keys; counts exact, losses to rounding
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == [1, 2, 3, 4, 5, 6, 6]
    for a, b in zip(rows1, rows2):
        assert set(a) == set(b)
        for k in set(a) - TIMING:
            if isinstance(a[k], float) and k.startswith(REDUCED):
                assert b[k] == pytest.approx(a[k], rel=REDUCED_RTOL, abs=1e-7), (a["step"], k, a[k], b[k])
            else:
                assert b[k] == a[k], (a["step"], k, a[k], b[k])
    worst = max(
        abs(b[k] - a[k]) / max(abs(a[k]), 1e-30)
        for a, b in zip(rows1, rows2)
        for k in set(a) - TIMING
        if isinstance(a[k], float) and k.startswith(REDUCED)
    )
    print(f"two ranks vs one: max relative difference of the reduced metrics {worst:.2e}")

    # the same weights
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    diff = max(float((w1[k] - w2[k]).abs().max()) for k in w1 if w1[k].is_floating_point())
    assert diff <= 5e-6, diff

    # the same settings again reuse the cached warm start (no training) and the run dir names it
    from draft_opd_ray.sft.stage import run_sft_stage

    cfg = _config(tmp_path / "one", tiny_target, 1)
    again = tmp_path / "again"
    again.mkdir()
    metrics = MetricsLogger(again, wandb_mode="disabled")
    got = run_sft_stage(
        cfg,
        target=str(tiny_target),
        prompts=_prompts_with_cached_answers(cfg, tiny_target),
        run_dir=again,
        metrics=metrics,
    )
    metrics.close()
    assert got == warm1 and (again / "warm_start").read_text() == f"{warm1}\n"
    assert not (again / "checkpoints").exists()
