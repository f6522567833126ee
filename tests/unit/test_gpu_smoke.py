"""`launch/gpu_smoke.sh` on a machine without a GPU: `--check` says so in one line (exit 2), and `--dry-run` runs
every command the smoke run would (each stage's `main` with dry_run=true, the multi-GPU stage planned for 4 GPUs),
so a typo in an override fails here, not on the GPU machine. The driver/CUDA table and the per-stage report are
checked on their own."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from draft_opd_ray.gpu_check import DRIVER_FLOOR, driver_verdict, line, report, stage_summaries

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "gpu_smoke.sh"
no_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")


@no_gpu
def test_check_without_a_gpu_prints_one_line_and_exits_2() -> None:
    out = subprocess.run([str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) == 1, lines
    assert "no GPU" in lines[0]


@no_gpu
def test_a_run_without_a_gpu_stops_at_the_check(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(SCRIPT), "--run-dir", str(tmp_path / "smoke")], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "no GPU" in out.stdout
    assert not (tmp_path / "smoke").exists()


def test_dry_run_validates_every_command(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(SCRIPT), "--dry-run", "--run-dir", str(tmp_path / "smoke")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    for stage in ("one", "serve", "multi"):
        assert f"[gpu-smoke] {stage} dry run: exit 0" in text
    # the serve stage, planned for 4 GPUs: the engine on GPU 0, the learner's side on GPU 1, NCCL refits
    assert "[gpu-smoke] serve | GPUs: vLLM's engine on ['0']; the learner's side" in text
    assert "[gpu-smoke] serve | refit: vLLM's draft weight transfer, NCCL from the learner's GPU" in text
    assert text.count("placement plan for cluster") == 2
    assert "tensor_parallel_size=2" in text and "data-parallel size 2" in text  # the multi-GPU stage's plan
    assert "dry run PASS" in text
    assert not [f for f in (tmp_path / "smoke").rglob("*") if f.is_file()]  # a dry run leaves no file


def test_dry_run_fails_on_a_bad_override(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(SCRIPT), "--dry-run", "--run-dir", str(tmp_path / "smoke"), "opd.stepz=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "dry run FAIL" in out.stdout and "stepz" in out.stdout


@pytest.mark.parametrize(
    ("driver", "cuda", "verdict"),
    [
        ("535.183.01", "13.0", "fail"),  # an A100 fleet's LTS branch cannot run the CUDA 13 wheels
        ("550.54.15", "13.0", "fail"),
        ("580.65.06", "13.0", "ok"),
        ("590.44.01", "13.0", "ok"),
        ("535.183.01", "12.8", "warn"),  # CUDA 12 by minor version compatibility
        ("570.124.06", "12.8", "ok"),
        ("580.65.06", "12.6", "ok"),
        ("520.61.05", "12.1", "fail"),
        ("470.256.02", "11.8", "ok"),
        ("580.65.06", "14.0", "warn"),  # no floor known
    ],
)
def test_driver_against_cuda(driver: str, cuda: str, verdict: str) -> None:
    got, why = driver_verdict(driver, cuda)
    assert got == verdict, why
    assert DRIVER_FLOOR[13] == 580 and DRIVER_FLOOR[12] == 525


def _run_dir(tmp_path: Path, opd_steps: int, before: bool = True) -> Path:
    d = tmp_path / "one"
    (d / "eval").mkdir(parents=True)
    rows = [
        {"stage": "sft", "step": i, "time": i, "loss": 3.0 - i / 50, "tokens": 100 * i} for i in range(1, 51)
    ]
    rows += [
        {"stage": "opd", "step": s, "loss": 0.5, "tau": 1.1, "step_s": 4.0, "replay_payload_mb": 0.4}
        for s in range(1, opd_steps + 1)
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = {"n": 16, "tau": 1.3, **({"before": {"tau": 1.2}} if before else {})}
    (d / "eval" / "report.json").write_text(json.dumps({"datasets": {"mtbench": entry}}))
    return d


def test_report_has_one_line_per_stage_and_a_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _run_dir(tmp_path, 3)
    assert report(tmp_path, [("one", d, 0, 300.0, 3)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[1] for x in lines[:3]] == ["one/sft", "one/opd", "one/eval"]
    assert all(" PASS" in x for x in lines)
    assert "50 steps" in lines[0] and "before 1.200 -> after 1.300" in lines[2]
    doc = json.loads((tmp_path / "smoke_report.json").read_text())
    assert doc["status"] == "PASS" and [s["stage"] for s in doc["stages"]] == [
        "one/sft",
        "one/opd",
        "one/eval",
    ]


def test_a_planned_stage_that_never_started_fails(tmp_path: Path) -> None:
    """The run died in its sft stage (no row logged): sft, opd and eval are each reported, sft first as FAIL."""
    d = tmp_path / "one"
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("stages: [sft, opd, eval]\n")
    stages = stage_summaries(d, 1, 30.0, "one", 3)
    assert [(s["stage"], s["status"]) for s in stages] == [
        ("one/sft", "FAIL"),
        ("one/opd", "FAIL"),
        ("one/eval", "FAIL"),
    ]
    assert "exit code 1" in stages[0]["why"]


def test_report_names_the_stage_that_failed(tmp_path: Path) -> None:
    d = _run_dir(tmp_path, 2, before=False)  # the run died after opd step 2
    stages = stage_summaries(d, 1, 100.0, "one", 3)
    status = {s["stage"]: s["status"] for s in stages}
    assert status == {"one/sft": "PASS", "one/opd": "FAIL", "one/eval": "FAIL"}
    opd = next(s for s in stages if s["stage"] == "one/opd")
    assert "exit code 1" in opd["why"] and "expected [1, 2, 3]" in opd["why"]
    assert "FAIL" in line(opd)
    assert report(tmp_path, [("one", d, 1, 100.0, 3)]) == 1


def test_the_teacher_stage_reports_check_teachers_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage `teacher`: check_teacher's JSON line (capture on the GPU runner against the replay) decides it; no
    line (the check died) is a FAIL that says where to look."""
    good = tmp_path / "good"
    good.mkdir()
    (good / "check_teacher.json").write_text(
        json.dumps(
            {
                "ok": True,
                "positions": 900,
                "topk_mismatches": 0,
                "max_abs_logprob_diff": 2e-5,
                "max_abs_feature_diff": 1e-5,
                "features_captured": True,
                "tolerance": 1e-4,
            }
        )
    )
    assert report(tmp_path, [("teacher", good, 0, 60.0, 0)]) == 0
    out = capsys.readouterr().out
    assert "teacher/check_teacher PASS: 900 positions, top-k mismatches 0" in out
    bad = tmp_path / "bad"
    bad.mkdir()
    assert report(tmp_path, [("teacher", bad, 1, 60.0, 0)]) == 1
    assert (
        "teacher/check_teacher FAIL (exit code 1; no JSON line from check_teacher" in capsys.readouterr().out
    )


def test_the_serve_stage_reports_the_demos_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage `serve`: the serve demo's report.json decides it: every request served, a candidate judged."""

    def arm(failed: int, published: list[int]) -> dict[str, object]:
        return {
            "requests_sent": 24,
            "requests_failed": failed,
            "tau": {"tau": 1.8},
            "published": published,
            "refused": [],
        }

    good = tmp_path / "good"
    good.mkdir()
    (good / "report.json").write_text(
        json.dumps({"arms": {"learning": arm(0, [1, 2]), "static": arm(0, [])}})
    )
    assert report(tmp_path, [("serve", good, 0, 200.0, 0)]) == 0
    out = capsys.readouterr().out
    assert "serve/serve PASS: learning 24 requests, 0 failed, τ 1.8" in out and "published [1, 2]" in out
    failing = tmp_path / "failing"
    failing.mkdir()
    (failing / "report.json").write_text(json.dumps({"arms": {"learning": arm(2, []), "static": arm(0, [])}}))
    assert report(tmp_path, [("serve", failing, 0, 200.0, 0)]) == 1
    assert "serve/serve FAIL (2 request(s) failed)" in capsys.readouterr().out
    none = tmp_path / "none"
    none.mkdir()
    assert report(tmp_path, [("serve", none, 1, 200.0, 0)]) == 1
    assert "no report.json from the serve demo" in capsys.readouterr().out
