"""The draft-kinds table (`drafts/registry.py`): every entry's pieces live in its own folder and round-trip a
draft, an unknown kind is a config error naming draft.kind (refused by validation before anything loads), and no
module outside a kind's folder compares kind names."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import draft_opd_ray
from draft_opd_ray.config.schema import DraftConfig
from draft_opd_ray.config.store import compose
from draft_opd_ray.drafts.registry import KINDS, draft_kind
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.rollout.engine import speculative_config

PACKAGE = Path(draft_opd_ray.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_entry_resolves(name: str) -> None:
    """Its pieces import and live in the kind's folder (load, save, fresh and the reference drafter run for real
    in the round trip below), the vLLM method is what the engine asks for, and a config group exists."""
    k = draft_kind(name)
    assert k.name == name and KINDS[name] is k
    p = k.pieces()
    pieces = [p.load, p.save, p.student, p.recipe, p.drafter] + ([p.fresh] if k.starts_fresh else [])
    assert {f.__module__.rsplit(".", 1)[0] for f in pieces} == {f"draft_opd_ray.drafts.{name}"}
    assert isinstance(p.student, type)
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


def test_unknown_kind_is_refused_by_validation_before_torch_loads() -> None:
    """`draft.kind=x` composes (config/ knows no kinds) and validation refuses it with the table's message; the
    table, the kinds' checks and validation import no torch."""
    code = (
        "import sys\n"
        "from draft_opd_ray.config.store import compose\n"
        "from draft_opd_ray.preflight import validate\n"
        "from draft_opd_ray.errors import ConfigError\n"
        "try:\n"
        "    validate(compose(['draft.kind=x']))\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "draft.kind: must be one of ['eagle3', 'standalone', 'dflash'], got 'x'"


def test_only_eagle3_starts_fresh(tiny_target: Path) -> None:
    for name in ("standalone", "dflash"):
        with pytest.raises(
            ConfigError, match=f"draft.path: a {name} draft needs draft.path or the sft stage"
        ):
            draft_kind(name).fresh(tiny_target, DraftConfig(kind=name), 0)
    head = draft_kind("eagle3").fresh(tiny_target, DraftConfig(), 0)
    assert head.config.aux_layer_ids == (1, 2, 3)  # the default of a 4-layer target


def _draft(name: str, target: Path, out: Path) -> Path:
    from draft_opd_ray.drafts.dflash.model import init_dflash, save_dflash
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

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
    recs = speculative_generate(target, drafter, prompts, num_speculative_tokens=3, max_new_tokens=8)
    assert [r.response_ids for r in recs] == target_generate(target, prompts, max_new_tokens=8)
    assert all(consistency_error(r) is None and r.num_steps > 0 for r in recs)


KIND_COMPARISON = re.compile(
    r"""(?:[!=]=|\bis(?:\s+not)?)\s*(['"])(?:eagle3|standalone|dflash)\1"""
    r"""|(['"])(?:eagle3|standalone|dflash)\2\s*(?:[!=]=)"""
    r"""|\bin\s*[(\[{][^)\]}]*(['"])(?:eagle3|standalone|dflash)\3"""
)


def test_no_module_outside_a_kinds_folder_compares_kind_names() -> None:
    """Everything that depends on the kind asks its `DraftKind` (drafts/registry.py): `kind == "dflash"` outside
    drafts/<kind>/ is a second table that drifts."""
    assert KIND_COMPARISON.search('if d.kind == "dflash":') and KIND_COMPARISON.search("'eagle3' != kind")
    assert KIND_COMPARISON.search('kind in ("standalone", "x")') and not KIND_COMPARISON.search(
        'kind="eagle3"'
    )
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.parent == PACKAGE / "drafts" and path.parent.name in KINDS:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if KIND_COMPARISON.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


ROLES = ("rollout", "opd", "sft", "eval", "loop", "driver", "main")


def test_drafts_import_none_of_the_roles() -> None:
    """drafts/ sits below the roles: it may import models/, config, flops, wire.py, never rollout/, opd/, sft/,
    eval/, loop/ or the driver (which import it)."""
    import ast

    hits = []
    for path in sorted((PACKAGE / "drafts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mod = node.module if isinstance(node, ast.ImportFrom) and node.module else ""
            if mod.startswith("draft_opd_ray.") and mod.split(".")[1] in ROLES:
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {mod}")
    assert not hits, "\n".join(hits)
