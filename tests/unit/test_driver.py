"""The driver's pure pieces: which train prompts Draft-OPD rolls out on, and the draft it starts from when neither
an SFT stage nor draft.path gives one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from draft_opd_ray.config.schema import ClusterConfig, Config, DraftConfig, SFTConfig
from draft_opd_ray.driver import initial_draft, opd_prompts, ray_stages
from draft_opd_ray.errors import ConfigError


def _cfg(**nodes: object) -> Config:
    return dataclasses.replace(Config(), **nodes)  # type: ignore[arg-type]


def test_opd_rolls_out_on_the_prompts_after_the_sft_warm_start() -> None:
    train = [[i, i + 1] for i in range(5)]
    cfg = _cfg(sft=SFTConfig(num_prompts=3))
    assert sorted(opd_prompts(cfg, train)) == train[3:]
    assert opd_prompts(_cfg(sft=SFTConfig(num_prompts=4)), train) == [train[4]]
    # none left after the warm start's: all of them
    assert sorted(opd_prompts(_cfg(sft=SFTConfig(num_prompts=5)), train)) == train
    assert sorted(opd_prompts(_cfg(sft=SFTConfig(num_prompts=50)), train)) == train
    assert opd_prompts(cfg, []) == []


def test_opd_prompt_order_is_seeded() -> None:
    train = [[i] for i in range(200)]
    a = opd_prompts(_cfg(sft=SFTConfig(num_prompts=10), seed=0), train)
    assert a == opd_prompts(_cfg(sft=SFTConfig(num_prompts=10), seed=0), train)
    assert a != opd_prompts(_cfg(sft=SFTConfig(num_prompts=10), seed=1), train) and sorted(a) == train[10:]


def test_initial_draft_is_a_fresh_eagle3_head(tiny_target: Path, tmp_path: Path) -> None:
    from draft_opd_ray.drafts.eagle3.model import load_eagle3

    out = initial_draft(_cfg(), str(tiny_target), tmp_path)
    assert Path(out) == tmp_path / "draft_init"
    assert load_eagle3(out, tiny_target).config.aux_layer_ids == (1, 2, 3)
    with pytest.raises(ConfigError, match="draft.path: a standalone draft needs draft.path or the sft stage"):
        initial_draft(_cfg(draft=DraftConfig(kind="standalone")), str(tiny_target), tmp_path)


def test_eval_joins_the_reservation_on_gpu_clusters_only() -> None:
    """On a GPU cluster even `stages=[eval]` reserves the plan, so eval's engines run in a rollout bundle
    (`slot_call`) and never on a GPU of the driver's node that Ray does not account for."""
    assert "eval" not in ray_stages(Config())
    assert "eval" in ray_stages(Config(cluster=ClusterConfig(gpus_per_node=8)))
