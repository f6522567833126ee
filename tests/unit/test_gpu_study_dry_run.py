"""`bench/gpu_study.sh`, the 8B study this machine cannot run: its plan names 3 seeds and every arm for both draft
kinds, a machine without a GPU is refused in one line, the dry run validates every job's exact `main` command
(dry_run=true, offline, config-only stand-ins for the weights), and its two pieces of arithmetic (the power
estimate's variance and the chain acceptance model) agree with a simulation and with docs/scaling.md."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_study.sh"
ARMS = ["sft", "opd", "sft_rollouts", "sft_rollouts_soft", "fkl", "rkl", "random", "opd_redraft"]
KINDS = ["eagle3", "dflash"]
SEEDS = [0, 1, 2]


def _load(name: str) -> ModuleType:
    """A bench module as `python bench/<name>.py` sees it (bench/ on sys.path: gpu_study imports gpu_study_plan)."""
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve the module of their annotations
    spec.loader.exec_module(mod)
    return mod


def _study() -> ModuleType:
    return _load("gpu_study")


def _plan() -> ModuleType:
    return _load("gpu_study_plan")


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _jobs(plan: str) -> list[str]:
    return re.findall(r"^\[gpu-study\] job (\S+?)(?: \(arm|:)", plan, flags=re.M)


def test_plan_names_three_seeds_every_arm_and_the_power_n() -> None:
    out = _run("--plan", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "seeds 0, 1, 2" in out.stdout
    jobs = _jobs(out.stdout)
    expected = [f"{k}/{a}_s{s}" for k in KINDS for a in ARMS for s in SEEDS]
    assert set(expected) <= set(jobs), sorted(set(expected) - set(jobs))
    assert {f"{k}/plateau" for k in KINDS} <= set(jobs)
    assert "loss.objective=sft_on_rollouts_soft" in out.stdout
    # C4: random and its control differ in the anchor policy alone (both redraft)
    for arm, policy in (("random", "random"), ("opd_redraft", "error")):
        line = next(x for x in out.stdout.splitlines() if f"job eagle3/{arm}_s0 " in x)
        assert f"anchor.policy={policy} replay.mode=redraft" in line
    for kind in KINDS:
        assert re.search(rf"{kind}: at the measured SD .* -> n = \d+ prompts of validation", out.stdout)
    assert "primary endpoint" in out.stdout and "GPU-h" in out.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_refuses_in_one_line() -> None:
    out = _run(timeout=60)
    assert out.returncode == 2, out
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0], lines


def test_chain_model_matches_docs_scaling() -> None:
    """docs/scaling.md at K = 4, tau 2, R = 256: alpha 0.519, 119 error anchors, 265 branch tokens."""
    s = _plan()
    assert s.chain_alpha(2.0, 4) == pytest.approx(0.519, abs=1e-3)
    anchors, branch = s.anchors_and_branch(256, 2.0, 4)
    assert round(anchors) == 119 and round(branch) == 265


def test_t_quantile_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    s = _plan()
    for df in (1, 2, 4, 9):
        for p in (0.8, 0.975):
            assert s.t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-6)


def test_prompts_needed_gives_the_power_in_simulation() -> None:
    """Studies simulated at the n of each criterion find +0.1 about 80% of the time: the prompt-clustered mean
    at rho = 1 (a prompt's difference repeats exactly across seeds; z on its true SE), and the seed-level t over
    the per-seed means at rho = 0 (their spread widest; the shifted-t approximation gives ~0.77)."""
    stats = pytest.importorskip("scipy.stats")
    g, s = _study(), _plan()
    cfg = g.load(g.CONFIG, None, None)
    sd, seeds, seed_sd = 0.4, 3, cfg["power"]["seed_sd"]
    n = s.prompts_needed(cfg, sd, seeds)
    assert n["n"] == max(n["clustered"], n["seed_level"])
    rng = np.random.default_rng(0)
    a = rng.normal(0, sd, (4000, n["clustered"], 1))
    b = rng.normal(0, seed_sd, (4000, 1, seeds))
    est = (0.1 + a + b).mean(axis=(1, 2))
    se = np.sqrt(seed_sd**2 / seeds + sd**2 / n["clustered"])
    assert 0.77 < (est / se > 1.959964).mean() < 0.83
    means = (
        0.1
        + rng.normal(0, seed_sd, (20000, seeds))
        + rng.normal(0, sd / np.sqrt(n["seed_level"]), (20000, seeds))
    )
    t = means.mean(1) / (means.std(1, ddof=1) / np.sqrt(seeds))
    assert 0.72 < (t > stats.t.ppf(0.975, seeds - 1)).mean() < 0.85


def _export(run: Path, stage: str, step: int, **state: float) -> Path:
    import torch

    d = run / "checkpoints" / stage / f"step_{step}"
    (d / "draft").mkdir(parents=True)
    torch.save(dict(state), d / "training_state.pt")
    (run / "checkpoints" / stage / "latest").write_text(f"step_{step}\n")
    return d / "draft"


def _report(path: Path, taus: list[float]) -> None:
    """An eval report whose validation prompts each took 10 steps at the given tau."""
    per_prompt = [{"accepted": 10 * (t - 1), "steps": 10} for t in taus]
    tau = sum(t for t in taus) / len(taus)
    report = {"datasets": {"validation": {"tau": tau, "per_prompt": per_prompt}}}
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps(report))


@pytest.mark.parametrize(("gain", "plateaued"), [(0.01, True), (0.05, False)])
def test_gate_reads_the_last_doubling_and_placeholders_resolve(
    tmp_path: Path, gain: float, plateaued: bool
) -> None:
    """The run mode without a GPU: the plateau rule on the curve jobs' validation reports, {export:N} picks the
    first export at or past N trained tokens, {branch} the last, {flops:opd_s0} the finished arm's FLOPs."""
    s = _study()
    cfg = s.load(s.CONFIG, None, "eagle3")
    budget = s.sft_budget(cfg)
    root = tmp_path / "eagle3"
    plateau = root / "plateau"
    _export(plateau, "sft", 10, tokens=budget // 2 - 5)
    half = _export(plateau, "sft", 11, tokens=budget // 2 + 7)
    last = _export(plateau, "sft", 20, tokens=budget)
    _report(root / "curve" / str(budget // 2) / "eval", [1.5, 1.7, 1.6])
    _report(root / "curve" / str(budget) / "eval", [1.5 + gain, 1.7 + gain, 1.6 + gain])
    v = s.gate(cfg, "eagle3", root)
    assert v["plateaued"] is plateaued
    assert v["last_doubling_gain"] == pytest.approx(gain)
    assert json.loads((plateau / "plateau.json").read_text())["branch"] == str(last)

    opd = root / "arms" / "opd_s0"
    _export(opd, "opd", 100, flops={"flops_draft": 1.0e17, "flops_target": 5.0e17})
    (opd / "done").write_text("done\n")
    over = ["draft.path={export:" + str(budget // 2) + "}", "sft.study.start_from={branch}"]
    over += ["sft.study.max_flops={flops:opd_s0}", "seed=0"]
    job = s.Job("sft_s0", "eagle3", root, root / "arms" / "sft_s0", over)
    got = s.resolve(job, None).overrides
    assert got == [
        f"draft.path={half}",
        f"sft.study.start_from={last}",
        "sft.study.max_flops=6e+17",
        "seed=0",
    ]


def test_collect_writes_the_results_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished arm's eval report becomes results/<name>_<kind>/<set>/<arm>_s<seed>.json (and branch.json from
    the 'before' it measured), which the results reader loads with the primary endpoint from study.json."""
    from draft_opd_ray.eval.results import load_study

    s = _study()
    monkeypatch.setattr(s, "RESULTS", tmp_path / "results")
    cfg = s.load(s.CONFIG, None, "eagle3")
    root = tmp_path / "runs" / "eagle3"
    s.write_study_files(cfg, "eagle3")
    for arm, flops, tau in (("opd", 6.0e17, 1.8), ("sft", 5.9e17, 1.7)):
        run = root / "arms" / f"{arm}_s0"
        _export(
            run, arm if arm == "opd" else "sft", 7, flops_draft=1e17, flops_target=flops - 1e17, tokens=123
        )
        (run / "done").write_text("done\n")
        (run / "command.txt").write_text(f"commit abcdef1234567\npython -m draft_opd_ray.main {arm}\n")
        _report(run / "eval", [tau, tau + 0.1])
        report = json.loads((run / "eval" / "report.json").read_text())
        report["datasets"]["validation"]["before"] = {
            "tau": 1.5,
            "per_prompt": [{"steps": 10, "accepted": 5}] * 2,
        }
        (run / "eval" / "report.json").write_text(json.dumps(report))
        written = s.collect(cfg, s.Job(f"{arm}_s0", "eagle3", root, run, [], arm, 0))
        assert tmp_path / "results" / "gpu8b_eagle3" / "validation" / f"{arm}_s0.json" in written
    study, sets = load_study(tmp_path / "results" / "gpu8b_eagle3")
    assert study.primary is not None and (study.primary.arm, study.primary.baseline) == ("opd", "sft")
    labels = {r.label: r for r in sets["validation"]}
    assert set(labels) == {"branch", "opd_s0", "sft_s0"}
    assert labels["opd_s0"].flops == pytest.approx(6.0e17) and labels["branch"].flops is None
    assert [p.accepted for p in labels["opd_s0"].prompts] == [8, 9]


@pytest.mark.slow
def test_dry_run_validates_every_job() -> None:
    """Every job's exact command, run with dry_run=true (~2 min on 2 cores: 58 `main` processes)."""
    plan = _run("--plan", timeout=120)
    jobs = _jobs(plan.stdout)
    out = _run("--dry-run", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for job in jobs:
        assert f"[gpu-study] {job} | placement plan for cluster '8xA100'" in out.stdout, job
        assert f"[gpu-study] {job} dry run: exit 0" in out.stdout, job
    assert f"dry run PASS: every job validated ({len(jobs)} jobs)" in out.stdout
    assert len(jobs) == len(KINDS) * (1 + 4 + len(ARMS) * len(SEEDS))
