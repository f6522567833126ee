"""A Hydra multirun of four jobs (two arms x two seeds, stages=[eval] on the tiny target through vLLM) and the
comparison report reading its sweep directory. Slow (four vLLM engines): `make test-slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draft_opd_ray.compare import main as compare_main
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_four_job_multirun_and_its_comparison(tiny_target: Path, tmp_path: Path) -> None:
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3

    draft = save_eagle3(init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2]), tmp_path / "draft", tiny_target)
    sweep = tmp_path / "sweep"
    r = helpers.run_main(
        "-m",
        "stages=[eval]",
        f"target.path={tiny_target}",
        f"draft.path={draft}",
        "data.eval.max_prompts=6",
        "eval.baselines=[]",
        "wandb.mode=disabled",
        "eval.max_new_tokens=16,32",
        "seed=0,1",
        f"hydra.sweep.dir={sweep}",
        timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / "eval" / "report.json").is_file())
    assert len(jobs) == 4
    report = json.loads((jobs[0] / "eval" / "report.json").read_text())["datasets"]["mtbench"]
    assert report["n"] >= 1 and len(report["per_prompt"]) == 6 and len(report["tau_ci"]) == 2

    out = tmp_path / "cmp"
    compare_main([str(sweep), "--out", str(out), "--baseline", "eval.max_new_tokens=16"])
    result = json.loads((out / "compare.json").read_text())
    assert set(result["arms"]) == {"eval.max_new_tokens=16", "eval.max_new_tokens=32"}
    assert all(sorted(a["seeds"]) == [0, 1] for a in result["arms"].values())
    assert (out / "compare.md").is_file() and (out / "tau_by_arm.png").is_file()
