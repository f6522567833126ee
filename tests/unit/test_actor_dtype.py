"""``dtype: auto`` is resolved on the node of the actor that computes in it, not on the driver's: a CPU-only
head (float32) must not hand float32 to replay actors and learner ranks on GPU nodes (bfloat16). The driver's
node and the actor's node are told apart by what `device.fast_bfloat16` answers while each side runs.
(The rollout engines: tests/conformance/test_engine_args.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import draft_opd_ray.device as device
from draft_opd_ray.config.schema import Config
from draft_opd_ray.loop import actors
from draft_opd_ray.placement import build_plan


def _node(monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """Run the next lines as on a node with (True) or without (False) fast bfloat16."""
    monkeypatch.setattr(device, "fast_bfloat16", lambda: gpu)


def _cfg() -> Config:
    cfg = Config()
    cfg.teacher = dataclasses.replace(cfg.teacher, dtype="auto")
    cfg.learner = dataclasses.replace(cfg.learner, dtype="auto")
    return cfg


def test_replay_actor_resolves_auto_on_its_node(monkeypatch: pytest.MonkeyPatch, tiny_target: Path) -> None:
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    _node(monkeypatch, gpu=False)  # the driver: a CPU-only head
    cfg = _cfg()
    cfg.teacher = dataclasses.replace(cfg.teacher, topk=None)  # the full payload: no draft copy to hold
    assert cfg.teacher.dtype == "auto"  # the actor gets the setting, not the driver's resolution of it
    _node(monkeypatch, gpu=True)  # the replay actor's node
    replay = ReplayActor(ReplayRun(str(tiny_target), [0], None), cfg.draft, cfg.teacher, cfg.loss, cfg.replay)
    assert replay.model.dtype == torch.bfloat16


class _Stop(Exception):
    pass


def test_learner_ranks_resolve_auto_on_their_node(
    monkeypatch: pytest.MonkeyPatch, tiny_target: Path, tmp_path: Path
) -> None:
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.opd import learner as learner_mod

    cfg = _cfg()
    plan = build_plan(cfg.cluster, draft_kind=cfg.draft.kind, zero_stage=cfg.learner.zero_stage)
    started: dict[str, Any] = {}
    monkeypatch.setattr(
        actors,
        "start_learner_ranks",
        lambda n, options, run, configs, **kw: started.update(run=run, configs=configs) or [],
    )
    _node(monkeypatch, gpu=False)  # the driver
    actors._learner_ranks(cfg, plan, str(tiny_target), "draft", 10, lambda role, rank: {}, cpu=True)
    assert started["configs"][3].dtype == "auto"

    # the rank on its node: the DeepSpeed engine is where the resolved dtype goes (no process group here)
    built: dict[str, Any] = {}

    def build_engine(*args: Any, **kw: Any) -> Any:
        built.update(kw)
        raise _Stop

    monkeypatch.setattr(learner_mod, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(learner_mod, "build_engine", build_engine)
    draft = save_eagle3(init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2]), tmp_path / "d", tiny_target)
    run = dataclasses.replace(started["run"], draft_dir=str(draft), target=str(tiny_target))
    _node(monkeypatch, gpu=True)
    with pytest.raises(_Stop):
        learner_mod.Learner(run, *started["configs"])
    assert built["dtype"] == "bfloat16"
