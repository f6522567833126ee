"""The draft-kinds table: every entry resolves to what it names and round-trips a draft through it, an unknown kind
is a config error naming draft.kind, and no other module of the package compares kind names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from draft_opd_ray.models.kinds import KINDS, draft_kind

import draft_opd_ray
from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.config.store import compose
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.rollout.engine import speculative_config

PACKAGE = Path(draft_opd_ray.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_entry_resolves(name: str) -> None:
    """The student class and the SFT recipe builder import (load, save, fresh and the reference drafter run for
    real in the round trip below), the vLLM method is what the engine asks for, and a config group exists."""
    k = draft_kind(name)
    assert k.name == name and KINDS[name] is k
    student, recipe = k.student(), k.recipe()
    # the student class serves the kind that names it
    assert isinstance(student, type) and student.kind == name
    assert callable(recipe) and recipe.__module__ == "draft_opd_ray.sft.recipes"
    assert speculative_config(name, "d", 4) == {
        "method": k.vllm_method,
        "model": "d",
        "num_speculative_tokens": 4,
    }
    assert compose([f"draft={name}"]).draft.kind == name


def test_unknown_kind_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(
        ConfigError, match=r"^draft\.kind: must be one of \['eagle3', 'standalone', 'dflash'\], got 'x'"
    ):
        draft_kind("x")
    with pytest.raises(ConfigError, match="draft.kind"):
        speculative_config("x", "d", 4)


def test_only_eagle3_starts_fresh(tiny_target: Path) -> None:
    for name in ("standalone", "dflash"):
        with pytest.raises(
            ConfigError, match=f"draft.path: a {name} draft needs draft.path or the sft stage"
        ):
            draft_kind(name).fresh(tiny_target, DraftConfig(kind=name), 0)
    head = draft_kind("eagle3").fresh(tiny_target, DraftConfig(), 0)
    assert head.config.aux_layer_ids == (1, 2, 3)  # the default of a 4-layer target


def _draft(name: str, target: Path, out: Path) -> Path:
    from draft_opd_ray.models.dflash import init_dflash, save_dflash
    from draft_opd_ray.models.standalone import build_standalone_from_target

    if name == "eagle3":
        return draft_kind(name).save(draft_kind(name).fresh(target, DraftConfig(), 0), out, target)
    if name == "standalone":
        return build_standalone_from_target(target, out, num_layers=1)
    return save_dflash(init_dflash(target, num_layers=1, block_size=4), out, target)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_draft_round_trips_through_the_table_and_drafts(
    tiny_target: Path, tmp_path: Path, name: str
) -> None:
    """load/save keep the weights and the architecture vLLM serves; the kind's reference drafter runs the loaded
    draft losslessly in the PyTorch reference engine."""
    import json

    from transformers import AutoModelForCausalLM

    from draft_opd_ray.rollout.reference import speculative_generate, target_generate
    from draft_opd_ray.wire import consistency_error

    k = draft_kind(name)
    folder = _draft(name, tiny_target, tmp_path / "a")
    model = k.load(folder, tiny_target)
    again = k.save(model, tmp_path / "b", tiny_target)
    if k.architecture:
        assert json.loads((again / "config.json").read_text())["architectures"] == [k.architecture]
    sd = k.load(again, tiny_target).state_dict()
    assert all(torch.equal(sd[n], v) for n, v in model.state_dict().items())
    assert sd.keys() == model.state_dict().keys()
    target = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    drafter = k.drafter(target, again, tiny_target)
    prompts = [[1, 45, 900, 12], [7, 300]]
    recs = speculative_generate(target, drafter, prompts, k=3, max_new_tokens=8)
    assert [r.response_ids for r in recs] == target_generate(target, prompts, max_new_tokens=8)
    assert all(consistency_error(r) is None and r.num_steps > 0 for r in recs)


KIND_COMPARISON = re.compile(
    r"""(?:[!=]=|\bis(?:\s+not)?)\s*(['"])(?:eagle3|standalone|dflash)\1"""
    r"""|(['"])(?:eagle3|standalone|dflash)\2\s*(?:[!=]=)"""
    r"""|\bin\s*[(\[{][^)\]}]*(['"])(?:eagle3|standalone|dflash)\3"""
)


def test_no_module_but_the_table_compares_kind_names() -> None:
    """Everything that depends on the kind asks models/kinds.py: `kind == "dflash"` elsewhere is a second
    table that drifts."""
    assert KIND_COMPARISON.search('if d.kind == "dflash":') and KIND_COMPARISON.search("'eagle3' != kind")
    assert KIND_COMPARISON.search('kind in ("standalone", "x")') and not KIND_COMPARISON.search(
        'kind="eagle3"'
    )
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "models" / "kinds.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_COMPARISON.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)
