"""`bench/study.py`: the overrides a plateau was trained with are kept beside its branch point and reach every arm,
so a study of a non-default draft (e.g. a 6-layer standalone slice) cannot branch into arms of another shape."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "study.py"


@pytest.fixture
def study(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[ModuleType, list[list[str]]]:
    spec = importlib.util.spec_from_file_location("study_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.chdir(tmp_path)
    calls: list[list[str]] = []

    def fake_sh(args: list[str], log: Path) -> None:  # records the command; writes what a finished run leaves
        calls.append(args)
        run = Path(next(a for a in args if a.startswith(("hydra.run.dir=", "resume="))).split("=", 1)[1])
        stage = "sft" if "stages=[sft]" in args or "plateau" in run.parts else "opd"
        for step in (1, 2):
            (run / "checkpoints" / stage / f"step_{step}" / "draft").mkdir(parents=True, exist_ok=True)
            torch.save(
                {"tokens": 1000 * step}, run / "checkpoints" / stage / f"step_{step}" / "training_state.pt"
            )
        (run / "checkpoints" / stage / "latest").write_text("step_2\n")

    monkeypatch.setattr(mod, "sh", fake_sh)
    return mod, calls


def run(mod: ModuleType, monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["study.py", *argv])
    mod.main()


def test_plateau_overrides_reach_every_arm(
    study: tuple[ModuleType, list[list[str]]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    mod, calls = study
    common = ("--kind", "standalone", "--name", "s6")
    run(
        mod,
        monkeypatch,
        "plateau",
        *common,
        "--tokens",
        "4000",
        "--doublings",
        "1",
        "--set",
        "draft.num_layers=6",
    )
    (plateau_cmd,) = calls
    assert "draft=standalone" in plateau_cmd and "draft.num_layers=6" in plateau_cmd
    assert "sft.study.curve_tokens=[2000]" in plateau_cmd and "sft.train_tokens=4000" in plateau_cmd
    info = json.loads(Path("runs/study/s6/plateau/plateau.json").read_text())
    assert info["overrides"] == ["draft.num_layers=6"]
    # the fake run stopped at 2,000 of 4,000 tokens (as sft.epochs can end one): the plateau says so
    assert (
        info["trained_tokens"] == 2000 and "trained 2,000 of --tokens 4,000 tokens" in capsys.readouterr().out
    )
    assert info["branch"].endswith("checkpoints/sft/step_2/draft")
    # a rerun finds the plateau trained: it keeps the overrides the checkpoints were made with
    run(mod, monkeypatch, "plateau", *common)
    assert len(calls) == 1
    assert json.loads(Path("runs/study/s6/plateau/plateau.json").read_text())["overrides"] == [
        "draft.num_layers=6"
    ]
    with pytest.raises(SystemExit, match="was trained with --set"):
        run(mod, monkeypatch, "plateau", *common, "--set", "draft.num_layers=4")

    run(
        mod,
        monkeypatch,
        "arms",
        *common,
        "--arms",
        "opd,fkl",
        "--steps",
        "3",
        "--set",
        "rollout.max_new_tokens=64",
    )
    opd_cmd, fkl_cmd = calls[1:]
    for cmd in (opd_cmd, fkl_cmd):
        assert "draft.num_layers=6" in cmd and "rollout.max_new_tokens=64" in cmd
        assert f"draft.path={info['branch']}" in cmd and "opd.steps=3" in cmd and "seed=0" in cmd
        assert "opd.checkpoint_every=5" in cmd  # a stopped arm resumes from at most 5 steps back
    assert "algorithm=forward_kl" in fkl_cmd and "algorithm=forward_kl" not in opd_cmd
    # the arm's own override comes after the plateau's: Hydra's last value wins
    assert opd_cmd.index("draft.num_layers=6") < opd_cmd.index("rollout.max_new_tokens=64")


def test_arms_before_a_plateau_is_one_clear_error(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, calls = study
    with pytest.raises(SystemExit, match="run `python bench/study.py plateau` for this study first"):
        run(mod, monkeypatch, "arms", "--name", "nothing_here")
    assert calls == []


def test_adopted_run_keeps_its_answers_precision(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An adopted default run trained its warm start on answers at `auto` precision (bfloat16 on a CPU with
    AVX512-BF16): the arms continue on those answers, not on the study's float32 ones."""
    mod, calls = study
    made = tmp_path / "made"
    for stage in ("sft", "opd"):
        (made / "checkpoints" / stage / "step_1" / "draft").mkdir(parents=True)
    (made / ".hydra").mkdir()
    (made / ".hydra" / "config.yaml").write_text("sft:\n  trajectory_dtype: bfloat16\n")
    run(mod, monkeypatch, "adopt", str(made), "--name", "short")
    info = json.loads(Path("runs/study/short/plateau/plateau.json").read_text())
    assert info["overrides"] == ["sft.trajectory_dtype=bfloat16"]
    run(mod, monkeypatch, "arms", "--name", "short", "--arms", "fkl", "--steps", "2")
    (cmd,) = calls
    assert "sft.trajectory_dtype=bfloat16" in cmd and "sft.trajectory_dtype=float32" not in cmd
    assert "sft.num_prompts=768" in cmd  # the rest of COMMON stays


def test_plateau_curve_rule_and_paired_gain(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule reads the pooled gain of the last doubling (< +0.02 tau: plateaued); each export also carries its
    per-prompt gain over the export before it, with a CI."""
    mod, _ = study
    root = Path("runs/study/s")
    run(mod, monkeypatch, "plateau", "--name", "s", "--tokens", "4000", "--doublings", "1")
    drafts = mod.checkpoints(root / "plateau", "sft")
    for i, d in enumerate(drafts):
        torch.save(
            {"tokens": 1000 * (i + 1), "flops_draft": 1e12 * (i + 1), "flops_target": 0.0},
            d.parent / "training_state.pt",
        )

    def entry(acc: list[int]) -> dict[str, object]:  # tau = 1 + accepted / steps, 10 steps a prompt
        per = [{"accepted": a, "steps": 10} for a in acc]
        tau = 1 + sum(acc) / (10 * len(acc))
        return {"tau": tau, "tau_ci": [tau - 0.1, tau + 0.1], "n": len(acc), "per_prompt": per}

    first, last = entry([3, 4, 5, 6] * 5), entry([4, 5, 6, 7] * 5)  # +0.1 on every prompt
    mod.plateau_curve(root, {str(drafts[0]): first, str(drafts[1]): last})
    info = json.loads((root / "plateau" / "plateau.json").read_text())
    assert info["plateaued"] is False and info["last_doubling_gain"] == pytest.approx(0.1)
    paired = info["last_doubling_paired"]
    assert paired["mean"] == pytest.approx(0.1) and paired["lo"] == pytest.approx(0.1) and paired["n"] == 20
    curve = json.loads((root / "plateau" / "eval" / "curve.json").read_text())
    assert "paired_prev" not in curve[0] and curve[1]["paired_prev"]["share_better"] == 1.0

    mod.plateau_curve(root, {str(drafts[0]): first, str(drafts[1]): entry([3, 4, 5, 6] * 5)})
    assert json.loads((root / "plateau" / "plateau.json").read_text())["plateaued"] is True
    # the chain reruns `plateau` before the arms: the measured verdict stays in plateau.json
    run(mod, monkeypatch, "plateau", "--name", "s")
    info = json.loads((root / "plateau" / "plateau.json").read_text())
    assert info["plateaued"] is True and info["branch"] == str(drafts[-1])

    # a guard (sft.epochs) ended training at 2,500 tokens, after the 2,000 mark: 2,000 -> 2,500 is no doubling, so
    # the rule reads 1,000 -> 2,500 (+0.1 over it, although flat since 2,000)
    extra = root / "plateau" / "checkpoints" / "sft" / "step_3"
    (extra / "draft").mkdir(parents=True)
    torch.save({"tokens": 2500, "flops_draft": 2.5e12, "flops_target": 0.0}, extra / "training_state.pt")
    drafts = mod.checkpoints(root / "plateau", "sft")
    mod.plateau_curve(root, {str(drafts[0]): first, str(drafts[1]): last, str(drafts[2]): last})
    info = json.loads((root / "plateau" / "plateau.json").read_text())
    assert info["plateaued"] is False and info["last_doubling_gain"] == pytest.approx(0.1)
    assert info["last_doubling_tokens"] == [1000, 2500] and info["last_doubling_paired"][
        "mean"
    ] == pytest.approx(0.1)
    curve = json.loads((root / "plateau" / "eval" / "curve.json").read_text())
    assert [c["tokens"] for c in curve] == [1000, 2000, 2500] and curve[2]["paired_prev"]["mean"] == 0.0


def test_a_run_stopped_midway_is_resumed_not_taken_as_done(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that stops mid-run leaves checkpoints but no finished marker (the plateau's plateau.json, the arm's
    `arm` file): the same command continues that run with `resume=`, and only a finished arm is measured or
    matched in FLOPs."""
    mod, calls = study
    monkeypatch.setattr(mod, "training_flops", lambda ckpt: 1e12)  # the finished opd arm's, for the sft arm
    plateau = Path("runs/study/s/plateau")
    (plateau / "checkpoints" / "sft" / "step_1" / "draft").mkdir(parents=True)
    (plateau / "checkpoints" / "sft" / "latest").write_text("step_1\n")
    run(mod, monkeypatch, "plateau", "--name", "s", "--tokens", "4000", "--doublings", "1")
    assert calls[-1][-1] == f"resume={plateau}" and len(calls) == 1
    assert json.loads((plateau / "plateau.json").read_text())["branch"].endswith("sft/step_2/draft")

    opd = Path("runs/study/s/arms/opd_s0")
    (opd / "checkpoints" / "opd" / "step_1" / "draft").mkdir(parents=True)
    (opd / "checkpoints" / "opd" / "latest").write_text("step_1\n")
    assert mod.final_draft(opd) is None  # stopped mid-run: not a finished arm
    with pytest.raises(SystemExit, match="run the opd arm first"):
        run(mod, monkeypatch, "arms", "--name", "s", "--arms", "sft")
    run(mod, monkeypatch, "arms", "--name", "s", "--arms", "opd,sft", "--steps", "2")
    resumed, sft = calls[1:]
    assert resumed[-1] == f"resume={opd}" and len(resumed) == 4  # python -m draft_opd_ray.main resume=...
    assert (opd / "arm").read_text() == "opd\n" and str(mod.final_draft(opd)).endswith("opd/step_2/draft")
    assert "stages=[sft]" in sft and "sft.study.max_flops=1000000000000.0" in sft
    run(mod, monkeypatch, "arms", "--name", "s", "--arms", "opd,sft", "--steps", "2")
    assert len(calls) == 3  # both finished: nothing re-run


def test_eval_keeps_each_measured_draft(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluation stopped after some drafts (a session's end) keeps their tau: the rerun measures only the rest,
    a draft whose weights were rewritten since (an arm re-run) is measured again, even when the new file carries
    the old one's modification time (a copy), and other prompts (a changed split) are another cache. The engine is
    replaced here: this tests the bookkeeping around `measure_drafts`, not tau."""
    import os

    import draft_opd_ray.eval.tau as tau_mod

    mod, _ = study
    drafts = [Path(f"d{i}") for i in range(3)]
    for i, d in enumerate(drafts):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w%d" % i)
    split = {"first": 1}
    monkeypatch.setattr(mod, "eval_prompts", lambda name, n, target: [[split["first"], 2]] * n)
    measured: list[str] = []

    def fake(target, kind, todo, prompts, *, on_measured, stop_after=None, **kw):  # type: ignore[no-untyped-def]
        out = {}
        for i, d in enumerate(todo):
            if stop_after is not None and i == stop_after:
                raise KeyboardInterrupt
            measured.append(str(d))
            out[str(d)] = {"tau": 1.0 + len(measured), "n": len(prompts)}
            on_measured(str(d), out[str(d)])
        return out

    monkeypatch.setattr(tau_mod, "measure_drafts", lambda *a, **kw: fake(*a, stop_after=2, **kw))
    with pytest.raises(KeyboardInterrupt):
        mod.measure("t", "standalone", drafts, ["validation"], 5, 64, Path("cache"))
    assert measured == ["d0", "d1"]
    monkeypatch.setattr(tau_mod, "measure_drafts", fake)
    got = mod.measure("t", "standalone", drafts, ["validation"], 5, 64, Path("cache"))["validation"]
    assert measured == ["d0", "d1", "d2"] and [got[str(d)]["tau"] for d in drafts] == [2.0, 3.0, 4.0]
    weights = drafts[1] / "model.safetensors"
    when = weights.stat().st_mtime_ns
    weights.write_bytes(b"new")  # d1 re-trained, its file copied in with the old modification time
    os.utime(weights, ns=(when, when))
    got = mod.measure("t", "standalone", drafts, ["validation"], 5, 64, Path("cache"))["validation"]
    assert measured[3:] == ["d1"] and got["d1"]["tau"] == 5.0 and got["d0"]["tau"] == 2.0
    mod.measure("t", "standalone", drafts, ["validation"], 10, 64, Path("cache"))  # another prompt count
    assert measured[4:] == ["d0", "d1", "d2"]
    split["first"] = 7  # the same count of other prompts
    mod.measure("t", "standalone", drafts, ["validation"], 10, 64, Path("cache"))
    assert (
        measured[7:] == ["d0", "d1", "d2"]
        and len(list(Path("cache").glob("taus_validation_n10_t64_*.json"))) == 2
    )


def test_study_chain_runs_the_named_arm_groups(tmp_path: Path) -> None:
    """`bench/plateau_study.sh`: KIND picks the plateau's budget and default arm groups, ARMS names the arm groups
    (`arms:seeds`, in order) and CURVE=0 skips the curve, so a session on a new machine can run one part of the
    chain; the default runs every group."""
    script = BENCH.parent / "plateau_study.sh"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "calls.txt"
    (bindir / "python").write_text(f'#!/usr/bin/env bash\necho "$*" >> {record}\n')  # records study.py's argv
    (bindir / "python").chmod(0o755)

    def chain(**env: str) -> list[str]:
        record.unlink(missing_ok=True)
        full = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "NAME": "s", **env}
        subprocess.run(["bash", str(script)], check=True, cwd=tmp_path, env=full)
        return [line.split(" ", 1)[1] for line in record.read_text().splitlines()]  # after bench/study.py

    default = chain()
    assert [c.split()[0] for c in default] == ["plateau", "eval", "arms", "arms", "eval"]
    assert "--kind standalone" in default[0] and "--set draft.num_layers=6 --tokens 740000" in default[0]
    assert "--arms opd,sft --seeds 0,1 --steps 15" in default[2]
    assert "--arms sft_rollouts,fkl,rkl,random --seeds 0 --steps 15" in default[3]
    part = chain(CURVE="0", ARMS="fkl,rkl:0 random:1")
    assert [c.split()[0] for c in part] == ["plateau", "arms", "arms", "eval"]
    assert "--arms fkl,rkl --seeds 0" in part[1] and "--arms random --seeds 1" in part[2]
    eagle = chain(KIND="eagle3")
    assert [c.split()[0] for c in eagle] == ["plateau", "eval", "arms", "eval"]
    assert "--kind eagle3" in eagle[0] and "--tokens 5120000 --doublings 6" in eagle[0]
    assert "--arms opd,sft,sft_rollouts --seeds 0,1 --steps 15" in eagle[2]
    bad = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env={**os.environ, "KIND": "x"}, capture_output=True
    )
    assert bad.returncode == 2 and b"expected standalone or eagle3" in bad.stderr


def test_plateau_from_the_cached_warm_start_when_the_run_dir_is_gone(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A new machine kept the cache but not runs/: `main` reuses the cached warm start (no checkpoints/sft, its
    `warm_start` note names the draft), and the plateau takes a copy of it as the branch point for the arms."""
    mod, calls = study
    cached = tmp_path / "cache" / "warm_starts" / "k" / "draft"
    cached.mkdir(parents=True)
    (cached / "model.safetensors").write_bytes(b"w")

    def reusing_sh(args: list[str], log: Path) -> None:
        calls.append(args)
        run = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1])
        run.mkdir(parents=True, exist_ok=True)
        (run / "warm_start").write_text(f"{cached}\n")

    monkeypatch.setattr(mod, "sh", reusing_sh)
    run(mod, monkeypatch, "plateau", "--name", "c", "--tokens", "4000", "--doublings", "1")
    info = json.loads(Path("runs/study/c/plateau/plateau.json").read_text())
    branch = Path(info["branch"])
    assert branch == Path("runs/study/c/plateau/branch/draft")
    assert (branch / "model.safetensors").read_bytes() == b"w"
    run(mod, monkeypatch, "arms", "--name", "c", "--arms", "opd", "--steps", "2")
    assert f"draft.path={branch}" in calls[-1]

    monkeypatch.setattr(mod, "sh", lambda args, log: calls.append(args))  # neither checkpoints nor a note
    with pytest.raises(SystemExit, match="left no checkpoints/sft and reused no warm start"):
        run(mod, monkeypatch, "plateau", "--name", "d", "--tokens", "4000", "--doublings", "1")


def test_a_controls_passes_repeat_the_students_work_not_the_target_forward(
    study: tuple[ModuleType, list[list[str]]],
) -> None:
    """The replay's target forward runs once a step whatever `learner.epochs` is: the seed-0 default run's numbers
    (opd 1.27e14; a control's target forwards 4.39e13 and student 2.06e13 a pass) need 4 passes, not the 2 that
    counting the target forward in every pass gives."""
    mod, _ = study
    assert mod.control_pass_count(1.27e14, 4.39e13, 2.06e13) == 4
    assert mod.control_pass_count(1.0e13, 4.39e13, 2.06e13) == 1  # never fewer than one pass
    flops = [4.39e13 + e * 2.06e13 for e in range(1, 8)]
    best = min(range(1, 8), key=lambda e: abs(flops[e - 1] - 1.27e14))
    assert mod.control_pass_count(1.27e14, 4.39e13, 2.06e13) == best


def test_export_writes_the_measured_counts_and_refuses_weights_changed_since(
    study: tuple[ModuleType, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export` reads the measurement of each draft from the cache of the setting it measured (same prompts) and
    writes it in the results format; a draft whose weights changed after its measurement stops the export (its τ
    would be published beside another draft's FLOPs)."""
    import draft_opd_ray.models.embedded as embedded

    mod, _ = study
    monkeypatch.setattr(mod, "eval_prompts", lambda name, n, target: [[1, 2]] * n)
    monkeypatch.setattr(embedded, "ensure_embedded_target", lambda: Path("target"))
    root = Path("runs/study/s")
    branch = root / "plateau" / "checkpoints" / "sft" / "step_4" / "draft"
    arm = root / "arms" / "opd_s0"
    draft = arm / "checkpoints" / "opd" / "step_2" / "draft"
    for d in (branch, draft):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(str(d).encode())
    (root / "plateau" / "plateau.json").write_text(json.dumps({"branch": str(branch), "overrides": []}))
    torch.save(
        {"tokens": 100, "flops": {"flops_draft": 1e12, "flops_target": 2e12}},
        draft.parent / "training_state.pt",
    )
    (arm / "checkpoints" / "opd" / "latest").write_text("step_2\n")
    for name, text in (
        ("arm", "opd"),
        ("command", "python -m draft_opd_ray.main ..."),
        ("commit", "abc1234"),
    ):
        (arm / name).write_text(text + "\n")
    counts = [{"steps": 3, "accepted": 1}, {"steps": 2, "accepted": 2}]
    cache = mod.cache_file(root / "eval", "validation", [[1, 2]] * 2, 64, "target")
    cache.parent.mkdir(parents=True)
    entry = {"tau": 1.6, "per_prompt": counts}
    cache.write_text(json.dumps({str(d): {"stamp": mod._stamp(d), "entry": entry} for d in (branch, draft)}))
    argv = ("export", "--name", "s", "--sets", "validation", "--eval-prompts", "2", "--max-new-tokens", "64")
    run(mod, monkeypatch, *argv, "--to", "results/s")
    rec = json.loads(Path("results/s/validation/opd_s0.json").read_text())
    assert rec["flops"] == 3e12 and rec["commit"] == "abc1234" and rec["k"] == 4
    assert rec["prompts"] == [
        {"key": "0", "steps": 3, "accepted": 1},
        {"key": "1", "steps": 2, "accepted": 2},
    ]
    (draft / "model.safetensors").write_bytes(b"re-trained")
    with pytest.raises(SystemExit, match="weights changed since they were measured"):
        run(mod, monkeypatch, *argv, "--to", "results/s")


def test_a_pinned_study_runs_at_its_commit_only(tmp_path: Path) -> None:
    """`bench/controls_study.sh`: a results dir with a `pinned` commit refuses another checkout (exit 2, with the
    worktree command), so no seed of a study runs other code or another prompt split than its first."""
    script = BENCH.parent / "controls_study.sh"
    head = subprocess.run(
        ["git", "-C", str(BENCH.parent), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    bindir, results = tmp_path / "bin", tmp_path / "results"
    bindir.mkdir()
    results.mkdir()
    (bindir / "python").write_text("#!/usr/bin/env bash\nexit 0\n")  # study.py and compare do nothing here
    (bindir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "RESULTS": str(results), "SEEDS": "0"}
    (results / "pinned").write_text("0000000\nwhy\n")
    bad = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (
        bad.returncode == 2 and "pinned to commit 0000000" in bad.stderr and "git worktree add" in bad.stderr
    )
    (results / "pinned").write_text(f"{head}\n")
    ok = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
