"""DeepSpeed's own checkpoint (what the SFT stage saves and resumes: `engine.save_checkpoint` /
`engine.load_checkpoint` through `checkpoint.safe_checkpoint_engine`) under ZeRO-1 and ZeRO-2 in bfloat16: every
file it writes reads back with `load_state` (weights_only: nothing unpickled), and an engine resumed from it takes
the same steps as the engine left alone.

Tolerance: exact (==). The resumed engine holds the same bf16 weights, fp32 master partition, AdamW moments and
lr schedule position, and runs the same ops on the same CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    from draft_opd_ray.distributed import init_process_group, release_process_group

    init_process_group("gloo")
    yield
    release_process_group()  # DeepSpeed's cached groups too: a later module's engine would find them stale


def _engine(zero_stage: int) -> Any:
    from draft_opd_ray.optim import build_engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    engine, _, _ = build_engine(
        model,
        list(model.parameters()),
        lr=1e-2,
        betas=[0.9, 0.95],
        weight_decay=0.01,
        zero_stage=zero_stage,
        dtype="bfloat16",
        grad_clip=1.0,
        lr_lambda=lambda s: 1.0 / (1 + s),  # the resumed engine must continue the schedule, not restart it
    )
    return engine


def _steps(engine: Any, n: int, start: int) -> list[float]:
    losses = []
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((engine(x.to(torch.bfloat16)).float() - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_checkpoint_resumes_exactly_without_unpickling(
    group: None, tmp_path: Path, zero_stage: int
) -> None:
    from draft_opd_ray.checkpoint import load_state

    run = _engine(zero_stage)
    _steps(run, 3, 0)
    run.save_checkpoint(str(tmp_path), tag="state", save_latest=False)
    left_alone = _steps(run, 3, 3)
    files = sorted((tmp_path / "state").glob("*.pt"))
    assert any("optim_states" in f.name for f in files)
    for f in files:
        load_state(f)  # raises on any pickled object

    resumed = _engine(zero_stage)
    resumed.load_checkpoint(str(tmp_path), tag="state")
    assert _steps(resumed, 3, 3) == left_alone
