"""The GPU study (issue 40 item 6): Draft-OPD against SFT after an SFT plateau, on an 8B target with EAGLE-3 at
K = 8 and DFlash at block 16, 3 seeds, every arm of docs/results.md. `bench/gpu_study.sh` runs this file:

    bash bench/gpu_study.sh --plan        # the plan: power estimate, analysis plan, GPU-hours, every job's command
    bash bench/gpu_study.sh --dry-run     # the plan, then every job's command with dry_run=true (no GPU, offline)
    bash bench/gpu_study.sh [--commit]    # on an 8-GPU node: the jobs in order; run it again after any stop

Its settings are bench/gpu_study.yaml. Each job is one `python -m draft_opd_ray.main ...` run in its own run dir
under runs/gpu_study/<name>/<kind>/: a finished job (its `done` file) is skipped, a job stopped mid-way continues
from its last complete checkpoint (`resume=<run dir>`), and no job trains longer than ~50 minutes between two
checkpoints (the SFT exports and `opd.checkpoint_every` are spaced by the GPU-hour estimate, gpu_study_plan.py).
After each job its measurements go to results/<name>_<kind>/ (and _curve/) in the format of results/README.md (per
prompt: verification steps and accepted tokens), which `python -m draft_opd_ray.compare` reads; `--commit` commits
them. Between the plateau and the arms stands the rule: arms branch only from an export whose last doubling of SFT
compute gained < +0.02 τ on validation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from gpu_study_plan import (  # bench/, beside this file (`python bench/gpu_study.py` puts it on sys.path)
    SFT_MAX_SEQ,
    arm_estimate,
    control_epochs,
    eval_prompts,
    hours_lines,
    plateau_estimate,
    power_lines,
    rollouts_per_arm,
    sft_budget,
)

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "gpu_study.yaml"
RUNS = Path("runs/gpu_study")
RESULTS = Path("results")
EXIT_GATE = 3  # the plateau rule refused to branch


@dataclass
class Job:
    """One `python -m draft_opd_ray.main` run. Overrides may hold placeholders resolved when the job starts:
    {branch} (the plateau's last export), {export:N} (its export at N trained tokens), {flops:RUN} (the training
    FLOPs of another job's final checkpoint); a dry run puts stand-ins in their place."""

    name: str
    kind: str
    root: Path  # the kind's study folder: runs/gpu_study/<name>/<kind>
    run_dir: Path
    overrides: list[str]
    arm: str | None = None
    seed: int | None = None


# ------------------------------------------------------------------------------------------------ settings


def load(path: Path, target: str | None, kinds: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(path.read_text())
    cfg["target"] = target or cfg["target"]
    if cfg["target"] not in cfg["targets"]:
        raise SystemExit(f"gpu_study: TARGET={cfg['target']}: expected one of {', '.join(cfg['targets'])}")
    if kinds:
        cfg["kinds"] = kinds.split(",")
    bad = [k for k in cfg["kinds"] if k not in cfg["drafts"]]
    if bad:
        raise SystemExit(f"gpu_study: KINDS: unknown {bad}; expected {', '.join(cfg['drafts'])}")
    return cfg


# ------------------------------------------------------------------------------------------------ jobs


def common(cfg: dict[str, Any], kind: str, target_path: str, prompts: str) -> list[str]:
    """The overrides every job of a kind shares: target, draft, data, lengths, the answers."""
    t, s = cfg["targets"][cfg["target"]], cfg["sft"]
    train = s["answers"] + rollouts_per_arm(cfg)
    return [
        *t["overrides"],
        f"target.path={target_path}",
        *cfg["drafts"][kind]["overrides"],
        "data.train.source=jsonl",
        f"data.train.path={prompts}",
        "data.train.split=train",
        f"data.train.eval_fraction={cfg['data']['eval_fraction']}",
        f"data.train.max_prompts={train}",
        f"data.train.max_prompt_tokens={cfg['data']['max_prompt_tokens']}",
        f"sft.num_prompts={s['answers']}",
        f"sft.max_new_tokens={s['max_new_tokens']}",
        "sft.trajectory_dtype=bfloat16",
        f"rollout.max_new_tokens={cfg['opd']['rollout_tokens']}",
        "wandb.mode=disabled",
    ]


def eval_overrides(cfg: dict[str, Any], kind: str, sets: list[str]) -> list[str]:
    e = cfg["eval"]
    return [
        f"data.eval.max_prompts={eval_prompts(cfg, kind)}",
        f"eval.extra_sets=[{','.join(sets)}]",
        f"eval.max_new_tokens={e['max_new_tokens']}",
        *e["overrides"],
    ]


def marks(total: float, every: float) -> list[int]:
    """Checkpoint marks (trained tokens) at most ``every`` apart up to ``total``."""
    n = max(1, math.ceil(total / every))
    return [int(total * i / n) for i in range(1, n)]


def plateau_job(cfg: dict[str, Any], kind: str, base: list[str], root: Path) -> Job:
    budget, s = sft_budget(cfg), cfg["sft"]
    doubling = [budget >> i for i in range(s["doublings"], 0, -1)]
    # checkpoints between the exports, ~50 min of training apart: a stop loses at most that (resume=)
    every = plateau_estimate(cfg, kind)["tokens_per_hour"] * cfg["opd"]["checkpoint_minutes"] / 60
    extra = [m for m in marks(budget, every) if m not in doubling]
    curve = sorted({*doubling, *extra})
    over = [
        *base,
        *cfg["cluster"]["sft"],
        "stages=[sft]",
        f"sft.train_tokens={budget}",
        f"sft.study.curve_tokens=[{','.join(map(str, curve))}]",
        f"sft.batch_tokens={s['batch_tokens']}",
        f"sft.lr={s['lr']}",
        "sft.epochs=1000",
        "sft.reuse=false",
    ]
    return Job("plateau", kind, root, root / "plateau", over)


def curve_jobs(cfg: dict[str, Any], kind: str, base: list[str], root: Path) -> list[Job]:
    """Validation tau of the last `curve_evals` doubling exports (the rule reads the last two)."""
    budget, s = sft_budget(cfg), cfg["sft"]
    tokens = [budget >> i for i in range(s["curve_evals"] - 1, -1, -1)]
    evals = eval_overrides(cfg, kind, ["validation"])
    return [
        Job(
            f"curve_{t}",
            kind,
            root,
            root / "curve" / str(t),
            [*base, *cfg["cluster"]["sft"], "stages=[eval]", f"draft.path={{export:{t}}}", *evals],
        )
        for t in tokens
    ]


def arm_overrides(cfg: dict[str, Any], kind: str, arm: str, seed: int) -> list[str]:
    """One arm's own overrides: its algorithm, its plan, where it starts and how its compute is set."""
    a, steps = cfg["arms"][arm], cfg["opd"]["steps"]
    est = arm_estimate(cfg, kind, a["match"])
    over = [f"seed={seed}", *a["overrides"]]
    if a["match"] == "flops":  # SFT continued from the branch point until the same seed's opd FLOPs
        every = est["sft_tokens"] / max(est["hours"], 1e-9) * cfg["opd"]["checkpoint_minutes"] / 60
        return over + [
            *cfg["cluster"]["sft"],
            "sft.study.start_from={branch}",
            f"sft.study.max_flops={{flops:opd_s{seed}}}",
            "sft.train_tokens=null",
            "sft.epochs=1000",
            "sft.reuse=false",
            "sft.lr=1e-4",  # the Draft-OPD peak (optim.lr): the same schedule shape from the same point
            f"sft.batch_tokens={cfg['sft']['batch_tokens']}",
            f"sft.study.curve_tokens=[{','.join(map(str, marks(est['sft_tokens'], every)))}]",
        ]
    per_ckpt = max(1, int(cfg["opd"]["checkpoint_minutes"] / max(est["step_minutes"], 1e-9)))
    over += [*cfg["cluster"]["opd"], "draft.path={branch}", f"opd.steps={steps}"]
    over += [f"opd.checkpoint_every={min(per_ckpt, steps)}"]
    if a["match"] == "epochs":
        over.append(f"learner.epochs={control_epochs(cfg, kind)}")
    return over


def arm_jobs(cfg: dict[str, Any], kind: str, base: list[str], root: Path) -> list[Job]:
    """Every arm for every seed, seed by seed, `opd` before `sft` (which matches its FLOPs)."""
    order = ["opd", "sft", *[a for a in cfg["arms"] if a not in ("opd", "sft")]]
    evals = eval_overrides(cfg, kind, cfg["eval"]["extra_sets"])
    return [
        Job(
            f"{arm}_s{seed}",
            kind,
            root,
            root / "arms" / f"{arm}_s{seed}",
            [*base, *arm_overrides(cfg, kind, arm, seed), *evals],
            arm,
            seed,
        )
        for seed in cfg["seeds"]
        for arm in order
    ]


def all_jobs(cfg: dict[str, Any], target_path: str, prompts: str) -> list[Job]:
    jobs: list[Job] = []
    for kind in cfg["kinds"]:
        root = RUNS / cfg["name"] / kind
        base = common(cfg, kind, target_path, prompts)
        jobs += [
            plateau_job(cfg, kind, base, root),
            *curve_jobs(cfg, kind, base, root),
            *arm_jobs(cfg, kind, base, root),
        ]
    return jobs


# ------------------------------------------------------------------------------------------------ the plan


ANALYSIS = [
    "analysis plan (fixed before any run; docs/scaling.md, 'The GPU study'; results/<name>_<kind>/study.json):",
    "  primary endpoint, one per draft kind: Draft-OPD (opd) minus SFT continued at matched training FLOPs (sft),",
    "    per prompt, on the validation split (the prompt file's held-out hash split), averaged over the 3 seeds:",
    "    `python -m draft_opd_ray.compare results/<name>_<kind>` gives the 95% prompt-clustered bootstrap interval",
    "    (prompts resampled, each with its seed mean) and the seed-level t-interval over the per-seed means;",
    "    supported if both lie above zero, contradicted if both lie below, undecided otherwise (docs/results.md).",
    "  everything else is exploratory, reported with its interval and not read as a verdict on its own:",
    "    MT-Bench and HumanEval; C5 opd - sft_rollouts (hard labels) and opd - sft_rollouts_soft (the target's",
    "    top-k on the same committed tokens); C3 opd - fkl, opd - rkl; C4 opd_redraft - random (error vs random",
    "    anchors, both with replay.mode=redraft); each arm minus the branch point; P1 = tau(opd) / tau(sft).",
    "  C1: the plateau rule on validation (last doubling of SFT compute < +0.02 tau; results/<name>_<kind>_curve);",
    "    the arms branch only from an export that passes it (FORCE_ARMS=1 branches anyway: C1 then inconclusive).",
]


def caveats(cfg: dict[str, Any]) -> list[str]:
    tb = ", ".join(f"{k} {plateau_estimate(cfg, k)['feature_tb']:.2f} TB" for k in cfg["kinds"])
    return [
        "limits of the code today that this plan works around (each would change the GPU-hours):",
        f"  - SFT cuts every sequence at {SFT_MAX_SEQ} tokens (sft/trainer.py max_seq_len, no config key): the warm",
        f"    start trains on the first {SFT_MAX_SEQ - cfg['gpu']['prompt_tokens']} response tokens of each answer",
        "    while Draft-OPD's rollouts and the evaluation run to 2,048.",
        "  - the SFT answers come from one engine (rollout bundle 0), resumable every 256 prompts; the other GPUs",
        "    wait (counted in the GPU-hours).",
        f"  - the SFT feature cache (bf16 target features of every answer token) needs {tb} under the cache dir.",
    ]


def command(job: Job, python: str = "python") -> list[str]:
    """The job's command line (``python``: the interpreter that runs it; the plan prints plain `python`)."""
    return [python, "-m", "draft_opd_ray.main", *job.overrides, f"hydra.run.dir={job.run_dir}"]


def print_plan(cfg: dict[str, Any], jobs: list[Job]) -> None:
    t = cfg["targets"][cfg["target"]]
    print(
        f"[gpu-study] {cfg['name']}: target {cfg['target']} ({t['path']}), kinds {', '.join(cfg['kinds'])} "
        f"(eagle3 K = {cfg['drafts']['eagle3']['k']}, dflash block {cfg['drafts']['dflash']['k'] + 1}), seeds "
        f"{', '.join(map(str, cfg['seeds']))}, arms {', '.join(cfg['arms'])}; {len(jobs)} jobs on one "
        f"{cfg['gpus']}-GPU node"
    )
    s = cfg["sft"]
    print(
        f"[gpu-study] SFT set: {s['answers']:,} target answers of up to {s['max_new_tokens']:,} tokens; plateau "
        f"budget {sft_budget(cfg):,} trained tokens ({s['epochs']} epochs), exports at every doubling "
        f"({s['doublings']}); rule: last doubling < +{s['rule_gain']} tau on validation"
    )
    for line in [*ANALYSIS, *power_lines(cfg), *hours_lines(cfg), *caveats(cfg)]:
        print(f"[gpu-study] {line}")
    for j in jobs:
        tag = f" (arm {j.arm}, seed {j.seed})" if j.arm else ""
        print(f"[gpu-study] job {j.kind}/{j.name}{tag}: {' '.join(command(j))}")


# ------------------------------------------------------------------------------------------------ dry run


def stand_ins(cfg: dict[str, Any], where: Path, target_path: str, prompts: str) -> dict[str, str]:
    """Config-only folders for what a dry run has no copy of: the target (its public config.json), the prompt
    file (a few lines), and each kind's branch point (the config.json fields validation reads)."""
    t = cfg["targets"][cfg["target"]]["config"]
    out = {"target": target_path, "prompts": prompts}
    if not (Path(target_path) / "config.json").is_file():
        folder = where / "target" / cfg["target"]
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(t, indent=1) + "\n")
        eos = t["eos_token_id"] if isinstance(t["eos_token_id"], list) else [t["eos_token_id"]]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}) + "\n")
        out["target"] = str(folder)
    if not Path(prompts).is_file():
        out["prompts"] = str(where / "prompts.jsonl")
        lines = [json.dumps({"prompt": f"Stand-in prompt {i} of the dry run."}) for i in range(400)]
        Path(out["prompts"]).write_text("\n".join(lines) + "\n")
    for kind in cfg["kinds"]:
        d = where / f"branch_{kind}"
        d.mkdir()
        made = {"kind": kind, "target_num_layers": t["num_hidden_layers"]}
        shape = {"hidden_size": t["hidden_size"], "target_hidden_size": t["hidden_size"], "draft_opd": made}
        if kind == "eagle3":
            shape |= {"draft_vocab_size": 32000, "vocab_size": 32000}
        (d / "config.json").write_text(json.dumps(shape) + "\n")
        out[f"branch_{kind}"] = str(d)
    return out


def resolve(job: Job, stand_in: dict[str, Any] | None) -> Job:
    """The job with its placeholders filled: from ``stand_in`` in a dry run, else from the finished jobs."""
    out = []
    for o in job.overrides:
        key, _, value = o.partition("=")
        if value == "{branch}" or value.startswith("{export:"):
            if stand_in is not None:
                value = stand_in[f"branch_{job.kind}"]
            elif value == "{branch}":
                value = str(branch_point(job.root))
            else:
                value = str(export_at(job.root, int(value[len("{export:") : -1])))
        elif value.startswith("{flops:"):
            other = job.root / "arms" / value[len("{flops:") : -1]
            flops = stand_in[f"opd_flops_{job.kind}"] if stand_in is not None else final_flops(other)
            value = f"{float(flops):.6g}"
        out.append(f"{key}={value}")
    return dataclasses.replace(job, overrides=out)


def dry_run_one(job: Job) -> tuple[Job, int, str]:
    cmd = [*command(job, sys.executable), "dry_run=true"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    # the plan and any error line; the libraries' log lines ("[date time][logger][LEVEL] - ...") left out
    lines = [x for x in (r.stdout + r.stderr).splitlines() if not x.startswith("[20")]
    return job, r.returncode, "\n".join(lines)


def dry_run(cfg: dict[str, Any], target_path: str, prompts: str) -> int:
    """Every job's command with dry_run=true (validation and the placement plan; no Ray, no model), 0 if all
    pass. The target, the prompt file and the branch points are config-only stand-ins where absent; the FLOPs
    that the sft arm matches are the estimate's."""
    where = Path(tempfile.mkdtemp(prefix="gpu_study_dry_"))
    try:
        subs: dict[str, Any] = stand_ins(cfg, where, target_path, prompts)
        subs |= {f"opd_flops_{k}": arm_estimate(cfg, k, "opd")["flops"] for k in cfg["kinds"]}
        print(
            f"[gpu-study] dry run: target {subs['target']}, prompts {subs['prompts']} (stand-ins where absent)"
        )
        todo = [
            resolve(dataclasses.replace(j, run_dir=where / "runs" / j.kind / j.run_dir.name), subs)
            for j in all_jobs(cfg, subs["target"], subs["prompts"])
        ]
        failed = 0
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            for job, rc, text in pool.map(dry_run_one, todo):  # in job order, each as soon as it is done
                print(f"[gpu-study] {job.kind}/{job.name}: {' '.join(command(job))} dry_run=true")
                for line in text.splitlines():
                    print(f"[gpu-study] {job.kind}/{job.name} | {line}")
                print(f"[gpu-study] {job.kind}/{job.name} dry run: exit {rc}", flush=True)
                failed += rc != 0
        verdict = "PASS: every job validated" if not failed else f"FAIL: {failed} of {len(todo)} jobs"
        print(f"[gpu-study] dry run {verdict} ({len(todo)} jobs)")
        return 0 if not failed else 1
    finally:
        shutil.rmtree(where, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ run


def _exports(run_dir: Path, stage: str) -> list[Path]:
    found = (run_dir / "checkpoints" / stage).glob("step_*/draft")
    return sorted(found, key=lambda p: int(p.parent.name.split("_")[1]))


def _state(draft: Path) -> dict[str, Any]:
    import torch

    return dict(torch.load(draft.parent / "training_state.pt", weights_only=True))


def branch_point(root: Path) -> Path:
    found = _exports(root / "plateau", "sft")
    if not found:
        raise SystemExit(f"gpu_study: {root}/plateau has no SFT export: run the plateau job first")
    return found[-1]


def export_at(root: Path, tokens: int) -> Path:
    """The plateau's first export at or past ``tokens`` trained tokens (an export lands on the batch after its
    mark)."""
    for d in _exports(root / "plateau", "sft"):
        if int(_state(d).get("tokens", 0)) >= tokens:
            return d
    raise SystemExit(f"gpu_study: {root}/plateau has no export at {tokens:,} trained tokens")


def final_flops(run_dir: Path) -> float:
    """Training FLOPs (draft + target) of a finished job's last checkpoint, as bench/study.py counts them."""
    found = _exports(run_dir, "opd") or _exports(run_dir, "sft")
    if not (run_dir / "done").is_file() or not found:
        raise SystemExit(f"gpu_study: {run_dir} has not finished: its FLOPs set another arm's budget")
    return _flops(_state(found[-1]))


def gate(cfg: dict[str, Any], kind: str, root: Path) -> dict[str, Any]:
    """The plateau rule on the curve jobs' validation tau: the last doubling (budget/2 -> budget) gained less
    than `rule_gain`. Written to <root>/plateau/plateau.json (and to results/)."""
    from draft_opd_ray.eval.stats import paired_diff

    budget = sft_budget(cfg)
    rows = {}
    for t in (budget // 2, budget):
        report = json.loads((root / "curve" / str(t) / "eval" / "report.json").read_text())
        rows[t] = report["datasets"]["validation"]
    gain = rows[budget]["tau"] - rows[budget // 2]["tau"]
    verdict = {
        "branch": str(branch_point(root)),
        "plateaued": bool(gain < cfg["sft"]["rule_gain"]),
        "last_doubling_gain": gain,
        "last_doubling_tokens": [budget // 2, budget],
        "last_doubling_paired": paired_diff(rows[budget]["per_prompt"], rows[budget // 2]["per_prompt"]),
        "rule": f"gain < +{cfg['sft']['rule_gain']} tau on validation",
    }
    (root / "plateau" / "plateau.json").write_text(json.dumps(verdict, indent=2) + "\n")
    return verdict


def study_dirs(cfg: dict[str, Any], kind: str) -> tuple[Path, Path]:
    """results/<name>_<kind> (the arms) and results/<name>_<kind>_curve (the plateau's exports, C1)."""
    base = RESULTS / f"{cfg['name']}_{kind}"
    return base, base.with_name(base.name + "_curve")


def write_study_files(cfg: dict[str, Any], kind: str) -> None:
    """Each results dir's study.json (results/README.md): the question and the primary endpoint, written before
    any measurement lands there."""
    arms, curve = study_dirs(cfg, kind)
    d = cfg["drafts"][kind]
    what = f"{cfg['target']}, {kind} at K = {d['k']}, {len(cfg['seeds'])} seeds (bench/gpu_study.sh)"
    metas: dict[Path, dict[str, Any]] = {
        arms: {
            "question": f"Does Draft-OPD beat SFT continued at matched FLOPs after an SFT plateau? {what}",
            "primary": {"set": "validation", "arm": "opd", "baseline": "sft"},
            "baseline": "sft",
        },
        curve: {
            "question": f"Has SFT plateaued: did the last doubling of SFT compute gain < +0.02 tau? {what}",
            "primary": None,
            "baseline": f"export_{sft_budget(cfg) // 2}",
        },
    }
    for path, meta in metas.items():
        path.mkdir(parents=True, exist_ok=True)
        (path / "study.json").write_text(json.dumps({"name": path.name, **meta}, indent=2) + "\n")


def _flops(state: dict[str, Any]) -> float:
    f = state.get("flops", state)
    return float(f.get("flops_draft", 0.0)) + float(f.get("flops_target", 0.0))


def trained_draft(job: Job) -> Path:
    """The draft a finished job measured last: an arm's final checkpoint, a curve job's export (its draft.path)."""
    if job.arm:
        return (_exports(job.run_dir, "opd") or _exports(job.run_dir, "sft"))[-1]
    return Path(next(o.split("=", 1)[1] for o in job.overrides if o.startswith("draft.path=")))


def draft_file(
    cfg: dict[str, Any], job: Job, arm: str, seed: int | None, entry: dict[str, Any]
) -> dict[str, Any]:
    """One draft on one set, in the results format: per prompt its verification steps and accepted tokens, with
    the training FLOPs and tokens from its branch point (a curve export: from the start of SFT)."""
    lines = (job.run_dir / "command.txt").read_text().splitlines()
    state = _state(trained_draft(job)) if arm != "branch" else {}
    return {
        "arm": arm,
        "seed": seed,
        "set": entry["set"],
        "k": cfg["drafts"][job.kind]["k"],
        "max_new_tokens": cfg["eval"]["max_new_tokens"],
        "flops": _flops(state) if state else None,
        "tokens": int(state["tokens"]) if "tokens" in state else None,
        "command": lines[1] if job.arm and arm != "branch" else "",
        "eval_command": lines[1],
        "commit": lines[0].removeprefix("commit ")[:9],
        "draft": f"{job.kind}/{arm}" + ("" if seed is None else f"_s{seed}"),
        "prompts": [
            {"key": str(i), "steps": int(c["steps"]), "accepted": int(c["accepted"])}
            for i, c in enumerate(entry["per_prompt"])
        ],
    }


def collect(cfg: dict[str, Any], job: Job) -> list[Path]:
    """A finished job's measurements under results/ (results/README.md): an arm's final draft on every set (and
    the branch point, measured before it in the same engine, once); a curve job's export on validation."""
    arms, curve = study_dirs(cfg, job.kind)
    report = json.loads((job.run_dir / "eval" / "report.json").read_text())
    written = []
    for name, e in report["datasets"].items():
        rows: list[tuple[str, int | None, dict[str, Any]]] = (
            [(job.arm, job.seed, e)] if job.arm else [(job.name.replace("curve", "export"), 0, e)]
        )
        if job.arm and "before" in e and not (arms / name / "branch.json").is_file():
            rows.append(("branch", None, e["before"]))
        for arm, seed, entry in rows:
            rec = draft_file(cfg, job, str(arm), seed, {**entry, "set": name})
            out = (arms if job.arm else curve) / name / f"{arm if seed is None else f'{arm}_s{seed}'}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rec) + "\n")
            written.append(out)
    return written


def run_job(cfg: dict[str, Any], job: Job, commit: bool) -> None:
    """Run (or resume) one job; its `done` file marks it finished, its results are copied (and committed)."""
    if (job.run_dir / "done").is_file():
        print(f"[gpu-study] {job.kind}/{job.name}: done")
        return
    job = resolve(job, None)
    resumable = any((job.run_dir / "checkpoints").glob("*/latest"))
    cmd = (
        [sys.executable, "-m", "draft_opd_ray.main", f"resume={job.run_dir}"]
        if resumable
        else command(job, sys.executable)
    )
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / "command.txt").touch()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    note = job.run_dir / "command.txt"  # the commit and the job's command; a resume adds a line
    with note.open("a") as f:
        f.write(
            f"resumed at {head}: {' '.join(cmd)}\n"
            if note.stat().st_size
            else f"commit {head}\n{' '.join(cmd)}\n"
        )
    print(f"[gpu-study] {job.kind}/{job.name}: {' '.join(cmd)} (log {job.run_dir}/job.log)", flush=True)
    with (job.run_dir / "job.log").open("a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(
            f"gpu_study: {job.kind}/{job.name} failed ({rc}), see {job.run_dir}/job.log; run again to resume"
        )
    if job.arm:
        (job.run_dir / "arm").write_text(job.arm + "\n")
    (job.run_dir / "done").write_text("done\n")
    dest = [str(p) for p in collect(cfg, job)] if (job.run_dir / "eval" / "report.json").is_file() else []
    if commit and dest:
        commit_files(cfg, dest, f"{job.kind}/{job.name}")


def commit_files(cfg: dict[str, Any], paths: list[str], what: str) -> None:
    subprocess.run(["git", "add", *paths], check=True)
    msg = f"gpu_study {cfg['name']}: {what}"
    subprocess.run(["git", "commit", "-q", "-m", msg, "--", *paths], check=True)


def branch_allowed(cfg: dict[str, Any], kind: str, root: Path, commit: bool) -> bool:
    """The plateau rule before a kind's first arm; its verdict is kept beside the curve's results either way."""
    v = gate(cfg, kind, root)
    kept = study_dirs(cfg, kind)[1] / "plateau.json"
    shutil.copyfile(root / "plateau" / "plateau.json", kept)
    if commit:
        commit_files(cfg, [str(kept)], f"{kind} plateau rule")
    note = f"last doubling {v['last_doubling_gain']:+.3f} tau on validation"
    if v["plateaued"]:
        print(f"[gpu-study] {kind}: plateaued ({note})")
        return True
    if os.environ.get("FORCE_ARMS") == "1":
        print(
            f"[gpu-study] {kind}: NOT plateaued ({note}); FORCE_ARMS=1: the arms branch anyway, C1 inconclusive"
        )
        return True
    print(
        f"[gpu-study] {kind}: NOT plateaued by the rule ({note}): the arms would branch from a draft still "
        "learning; raise sft.epochs in bench/gpu_study.yaml under a new name, or FORCE_ARMS=1"
    )
    return False


def run_all(cfg: dict[str, Any], jobs: list[Job], commit: bool) -> int:
    """Every job in order, kind by kind; the plateau rule stands between a kind's curve and its arms."""
    for kind in cfg["kinds"]:
        root = RUNS / cfg["name"] / kind
        write_study_files(cfg, kind)
        kinds_jobs = [j for j in jobs if j.kind == kind]
        for job in kinds_jobs:
            if job is next(j for j in kinds_jobs if j.arm) and not branch_allowed(cfg, kind, root, commit):
                return EXIT_GATE
            run_job(cfg, job, commit)
    for kind in cfg["kinds"]:
        print(f"[gpu-study] {kind}: python -m draft_opd_ray.compare {study_dirs(cfg, kind)[0]}")
    return 0


def preflight(cfg: dict[str, Any], target_path: str, prompts: str) -> None:
    """What a real run needs before its first job: the weights' folder and enough prompts in each split."""
    from draft_opd_ray.config.schema import PromptSetConfig
    from draft_opd_ray.data.prompts import scan_prompt_file

    if not (Path(target_path) / "config.json").is_file():
        raise SystemExit(
            f"gpu_study: target {target_path}: no config.json (TARGET_PATH=<local copy of the weights>)"
        )
    need = cfg["sft"]["answers"] + rollouts_per_arm(cfg)
    frac = cfg["data"]["eval_fraction"]
    for split, n in (("train", need), ("eval", max(eval_prompts(cfg, k) for k in cfg["kinds"]))):
        ps = PromptSetConfig(source="jsonl", path=prompts, split=split, eval_fraction=frac)
        have = scan_prompt_file(ps, key=f"PROMPTS ({split} split)")
        if have < n:
            raise SystemExit(
                f"gpu_study: {prompts}: {have:,} prompts in the {split} split, the study needs {n:,}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--plan", action="store_true", help="print the plan and every job's command")
    mode.add_argument("--dry-run", action="store_true", help="the plan, then every command with dry_run=true")
    mode.add_argument("--run", action="store_true", help="run the jobs (an 8-GPU node; gpu_study.sh checks)")
    ap.add_argument("--commit", action="store_true", help="commit each finished job's results/ files")
    ap.add_argument("--config", type=Path, default=CONFIG)
    args = ap.parse_args()
    cfg = load(args.config, os.environ.get("TARGET"), os.environ.get("KINDS"))
    target_path = os.environ.get("TARGET_PATH", cfg["targets"][cfg["target"]]["path"])
    prompts = os.environ.get("PROMPTS", cfg["data"]["prompts"])
    jobs = all_jobs(cfg, target_path, prompts)
    print_plan(cfg, jobs)
    if args.dry_run:
        sys.exit(dry_run(cfg, target_path, prompts))
    if args.run:
        preflight(cfg, target_path, prompts)
        sys.exit(run_all(cfg, jobs, args.commit))


if __name__ == "__main__":
    main()
