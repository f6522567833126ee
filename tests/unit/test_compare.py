"""`python -m draft_opd_ray.compare` on fake run dirs: arms from Hydra overrides, τ over seeds, the gain over the
start draft, training FLOPs and the paired difference against the baseline arm (prompts clustered over seeds, the
seed-level interval beside it) checked against hand computation; multirun dirs expand to their runs; bad input is
one `error:` line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from draft_opd_ray.compare import arm_name, main, train_flops
from draft_opd_ray.eval.stats import bootstrap_indices

T_975_DF1 = 12.706204736174694  # t(0.975, 1): the 95% t-interval half-width factor for two seeds


def pooled(pp: list[dict[str, int]]) -> float:
    return 1 + sum(p["accepted"] for p in pp) / sum(p["steps"] for p in pp)


def write_run(
    path: Path,
    per_prompt: list[tuple[int, int]],
    *,
    overrides: list[str],
    seed: int | None = None,
    before: list[tuple[int, int]] | None = None,
    flops: list[tuple[float, float]] | None = None,
    curve: list[dict[str, float]] | None = None,
) -> Path:
    """A run dir: eval/report.json from (steps, accepted) per prompt, Hydra's files, metrics.jsonl."""
    pp = [{"steps": s, "accepted": a, "tokens": 1 + s + a} for s, a in per_prompt]
    entry: dict[str, Any] = {"tau": pooled(pp), "tau_vllm": pooled(pp), "n": len(pp), "per_prompt": pp}
    if before is not None:
        bp = [{"steps": s, "accepted": a, "tokens": 1 + s + a} for s, a in before]
        entry["before"] = {"tau": pooled(bp), "tau_vllm": pooled(bp), "per_prompt": bp}
    (path / "eval").mkdir(parents=True)
    (path / "eval" / "report.json").write_text(json.dumps({"target": "t", "datasets": {"mtbench": entry}}))
    (path / ".hydra").mkdir()
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if seed is not None:
        (path / ".hydra" / "config.yaml").write_text(
            yaml.safe_dump({"seed": seed, "draft": {"kind": "eagle3"}})
        )
    rows = [
        {"stage": "opd", "step": i, "flops_draft": d, "flops_target": t}
        for i, (d, t) in enumerate(flops or [])
    ]
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [{"stage": "sft", "step": 0}, *rows])
    )
    if curve is not None:
        (path / "eval" / "curve.json").write_text(json.dumps(curve))
    return path


A0 = [(4, 4), (5, 2), (3, 3)]  # arm "algorithm=fkl", seed 0
A1 = [(4, 2), (5, 5), (3, 1)]
B0 = [(4, 6), (5, 6), (3, 3)]  # arm "algorithm=rkl", seed 0
B1 = [(4, 5), (5, 4), (3, 2)]


def _two_arms(tmp_path: Path) -> list[Path]:
    fkl = ["algorithm=fkl", "hydra.run.dir=x"]
    rkl = ["algorithm=rkl"]
    curve = [{"flops": 1e12, "tau": 1.5, "n": 3}, {"flops": 2e12, "tau": 1.8, "n": 3}]
    return [
        write_run(
            tmp_path / "a0",
            A0,
            overrides=[*fkl, "seed=0"],
            seed=0,
            before=A1,
            flops=[(1e12, 2e12), (3e12, 4e12)],
        ),
        write_run(tmp_path / "a1", A1, overrides=[*fkl, "seed=1"], seed=1, before=A1, flops=[(5e12, 1e12)]),
        write_run(tmp_path / "b0", B0, overrides=[*rkl, "seed=0"], seed=0, flops=[(2e12, 2e12)], curve=curve),
        write_run(tmp_path / "b1", B1, overrides=[*rkl, "seed=1"], seed=1, flops=[(2e12, 3e12)]),
    ]


def _tau(pairs: list[tuple[int, int]]) -> float:
    return 1 + sum(a for _, a in pairs) / sum(s for s, _ in pairs)


def test_compare_table_matches_hand_computation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = _two_arms(tmp_path)
    out = tmp_path / "out"
    main([*map(str, runs), "--out", str(out)])
    result = json.loads((out / "compare.json").read_text())
    assert result["dataset"] == "mtbench" and result["baseline"] == "algorithm=fkl"
    assert list(result["arms"]) == ["algorithm=fkl", "algorithm=rkl"]

    fkl, rkl = result["arms"]["algorithm=fkl"], result["arms"]["algorithm=rkl"]
    t0, t1 = _tau(A0), _tau(A1)  # 1 + 9/12 = 1.75, 1 + 8/12
    assert fkl["seeds"] == [0, 1] and fkl["tau_per_seed"] == pytest.approx([t0, t1])
    half = T_975_DF1 * abs(t0 - t1) / 2  # t · s / √2 with s = |t0 − t1| / √2
    assert fkl["tau"] == pytest.approx(
        {"n": 2, "mean": (t0 + t1) / 2, "lo": (t0 + t1) / 2 - half, "hi": (t0 + t1) / 2 + half}
    )
    assert fkl["gain_over_before"]["mean"] == pytest.approx(((t0 - t1) + (t1 - t1)) / 2)
    assert fkl["flops"] == pytest.approx((7e12 + 6e12) / 2)  # the last row of each run
    assert fkl["vs_baseline"] is None and rkl["gain_over_before"] is None

    d = [
        [b_a / s - a_a / s for (s, a_a), (_, b_a) in zip(a, b)] for a, b in ((A0, B0), (A1, B1))
    ]  # rkl − fkl per prompt, d[seed][prompt]
    prompt_means = [
        (d[0][p] + d[1][p]) / 2 for p in range(3)
    ]  # a prompt's seeds are one cluster, not 2 prompts
    v = rkl["vs_baseline"]
    assert v["seeds"] == [0, 1] and v["n"] == v["prompts"] == 3 and v["unpaired_seeds"] == []
    assert v["mean"] == pytest.approx(sum(prompt_means) / 3)
    boot = [np.mean([prompt_means[i] for i in row]) for row in bootstrap_indices(3)]
    assert (v["lo"], v["hi"]) == pytest.approx((np.percentile(boot, 2.5), np.percentile(boot, 97.5)))
    seed_means = [sum(row) / 3 for row in d]  # the seed-level t-interval beside it
    half = T_975_DF1 * abs(seed_means[0] - seed_means[1]) / 2
    assert v["seed_level"]["per_seed"] == pytest.approx(seed_means)
    assert (v["seed_level"]["lo"], v["seed_level"]["hi"]) == pytest.approx(
        (np.mean(seed_means) - half, np.mean(seed_means) + half)
    )

    table = (out / "compare.md").read_text()
    assert capsys.readouterr().out == table
    m = fkl["tau"]
    assert (
        f"| algorithm=fkl | 2 | {m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}] | s0: {t0:.3f}, s1: {t1:.3f} |"
        in table
    )
    sl = v["seed_level"]
    assert (
        f"| {v['mean']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}] (3 prompts × 2 seeds) | "
        f"[{sl['lo']:+.3f}, {sl['hi']:+.3f}] |" in table
    )
    assert "| 6.5e+12 | (baseline) |" in table
    assert (out / "tau_by_arm.png").is_file() and (out / "tau_vs_compute.png").is_file()


def test_baseline_option_and_unpaired_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_run(tmp_path / "a", A0, overrides=["seed=3"], seed=3)
    b = write_run(tmp_path / "b", B0[:2], overrides=["lr=1"], seed=3)  # other prompts: no pairing
    c = write_run(
        tmp_path / "c", B1, overrides=["lr=2"]
    )  # seed 0 (no config.yaml): no run of arm lr=1 has it
    main([str(a), str(b), str(c), "--baseline", "lr=1", "--out", str(tmp_path / "o")])
    result = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert list(result["arms"]) == ["default", "lr=1", "lr=2"] and result["baseline"] == "lr=1"
    assert result["arms"]["default"]["vs_baseline"] is None and result["arms"]["lr=2"]["vs_baseline"] is None
    assert result["arms"]["lr=2"]["tau"] == {"n": 1, "mean": _tau(B1), "lo": _tau(B1), "hi": _tau(B1)}
    assert "- (no runs of the same seed on the same prompts)" in capsys.readouterr().out
    assert not (tmp_path / "o" / "tau_vs_compute.png").exists()  # no FLOPs, no curve: no plot


def test_a_multirun_dir_expands_to_its_runs(tmp_path: Path) -> None:
    multi = tmp_path / "multirun" / "2026-12-01" / "10-00-00"
    for i, seed in enumerate([0, 1, 2]):
        write_run(
            multi / f"{i}_seed={seed},algorithm=fkl",
            A0 if seed % 2 else A1,
            overrides=[f"seed={seed}", "algorithm=fkl"],
            seed=seed,
        )
    write_run(multi / "10_seed=0,algorithm=rkl", B0, overrides=["seed=0", "algorithm=rkl"], seed=0)
    (multi / "multirun.yaml").write_text("hydra: {}\n")
    (multi / ".submitit").mkdir()  # a subdir that is no run is left out
    main([str(multi), "--out", str(tmp_path / "o")])
    result = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert [Path(r["path"]).name for r in result["runs"]] == [
        "0_seed=0,algorithm=fkl",
        "1_seed=1,algorithm=fkl",
        "2_seed=2,algorithm=fkl",
        "10_seed=0,algorithm=rkl",
    ]
    assert result["arms"]["algorithm=fkl"]["seeds"] == [0, 1, 2]
    assert result["arms"]["algorithm=rkl"]["vs_baseline"]["seeds"] == [0]


def test_arm_name_and_train_flops() -> None:
    assert arm_name(
        ["seed=1", "algorithm=forward_kl", "hydra.run.dir=x", "+cluster=a", "hydra/launcher=j"]
    ) == ("algorithm=forward_kl,+cluster=a")
    assert arm_name(["seed=4"]) == arm_name([]) == "default"
    assert train_flops([{"flops_draft": 1.0, "flops_target": 2.0}, {"loss": 1}, {"flops_draft": 5.0}]) == 5.0
    assert train_flops([{"loss": 1}]) is None


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err.strip()


def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "o")]
    missing = tmp_path / "nope"
    assert _fails([str(missing), *out], capsys) == f"error: {missing}: does not exist"
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    assert _fails([str(empty), *out], capsys) == (
        f"error: {empty}: not a run directory (no eval/report.json) nor a results dir (no study.json)"
    )
    bad = write_run(tmp_path / "bad", A0, overrides=[])
    (bad / "eval" / "report.json").write_text("{not json")
    assert _fails([str(bad), *out], capsys).startswith(
        f"error: {bad / 'eval' / 'report.json'}: does not parse ("
    )
    good = write_run(tmp_path / "good", A0, overrides=[])
    assert "--baseline 'x': no such arm" in _fails([str(good), "--baseline", "x", *out], capsys)
    assert "no dataset 'gsm8k' (has: mtbench)" in _fails([str(good), "--dataset", "gsm8k", *out], capsys)


def test_arms_are_named_by_the_overrides_that_differ() -> None:
    from draft_opd_ray.compare import Run, distinct_arms

    def run(*ov: str) -> Run:
        return Run(path=Path("."), arm="", seed=0, report={}, overrides=list(ov))

    got = distinct_arms([run("target.path=t", "x=1", "seed=0"), run("target.path=t", "x=2", "seed=1")])
    assert [r.arm for r in got] == ["x=1", "x=2"]
    named = Run(path=Path("."), arm="opd", seed=0, report={})
    assert distinct_arms([named])[0].arm == "opd"
