"""A damaged draft folder is refused before any engine starts: `python -m draft_opd_ray.main` exits 2 with one
`error:` line naming the config key, the file and the first bad tensor, in seconds, and leaves no run dir (nor
anything in a resumed one), whether it is `draft.path` of a dry run or of stages=[eval], the draft of the opd
checkpoint a `resume=` continues from, or the sft stage's `sft.study.start_from`; the untouched folder's dry run
passes. Run as `test_bad_input.py` runs its cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import helpers

SECONDS = 45  # a case's budget: no model loads, no Ray, no engine


Case = helpers.BadInput


CASES = [
    Case(
        ("draft.path=TRUNCATED",),
        "draft.path: TRUNCATED/model.safetensors is damaged: truncated: tensor 't2d'",
    ),
    Case(
        ("stages=[eval]", "draft.path=TRUNCATED"),
        "draft.path: TRUNCATED/model.safetensors is damaged: truncated: tensor 't2d'",
        dry=False,
    ),
    Case(
        ("resume=RUN",),
        "resume: RUN/checkpoints/opd/step_1/draft/model.safetensors is damaged: truncated: tensor 't2d'",
    ),
    Case(
        ("stages=[sft]", "sft.study.start_from=SPECFORGE"),
        "sft.study.start_from: SPECFORGE is an EAGLE-3 head as SpecForge exports it",
    ),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, embedded_target: Path) -> dict[str, Path]:
    """An EAGLE-3 head for the embedded target (a 512-token draft vocabulary: a small file), a truncated copy, a
    copy whose config.json reads as SpecForge's, and a run dir whose opd checkpoint holds the truncated copy."""
    import torch

    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.models.target import read_target_info

    root = tmp_path_factory.mktemp("bad_drafts")
    vocab = read_target_info(embedded_target).vocab_size
    head = init_eagle3(embedded_target, draft_vocab_size=512, token_counts=torch.ones(vocab))
    f = {"GOOD": save_eagle3(head, root / "good", embedded_target)}
    f["TRUNCATED"] = Path(shutil.copytree(f["GOOD"], root / "truncated"))
    weights = f["TRUNCATED"] / "model.safetensors"
    with weights.open("r+b") as fh:
        fh.truncate(weights.stat().st_size - 1000)
    f["SPECFORGE"] = Path(shutil.copytree(f["GOOD"], root / "specforge"))
    helpers.edit_config(f["SPECFORGE"], lambda c: [c.pop(k) for k in ("eagle_config", "draft_opd")])
    f["RUN"] = root / "run"
    (f["RUN"] / ".hydra").mkdir(parents=True)
    (f["RUN"] / ".hydra" / "config.yaml").write_text("stages: [opd]\n")
    step = f["RUN"] / "checkpoints" / "opd" / "step_1"
    shutil.copytree(f["TRUNCATED"], step / "draft")
    (step / "training_state.pt").write_bytes(b"")
    (f["RUN"] / "checkpoints" / "opd" / "latest").symlink_to("step_1")
    return f


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c.overrides) for c in CASES])
def test_a_damaged_draft_is_one_line_exit_2_and_leaves_no_run_dir(
    case: Case, inputs: dict[str, Path], tmp_path: Path
) -> None:
    helpers.assert_refused(case, inputs, tmp_path / "run", SECONDS)


def test_the_untouched_draft_passes_a_dry_run(inputs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    r = helpers.run_main(f"draft.path={inputs['GOOD']}", "dry_run=true", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "placement plan" in r.stdout and not run_dir.exists()
