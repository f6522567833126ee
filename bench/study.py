"""The Draft-OPD vs SFT study under the plateau-first protocol (docs/results.md). Its commands, each resumable:

    python bench/study.py plateau [--kind eagle3]    # SFT on a fixed answer set, exports at every doubling
    python bench/study.py arms --arms opd,sft,sft_rollouts --seeds 0,1
    python bench/study.py eval                       # tau of the plateau exports and every arm (validation, ...)
    python bench/study.py adopt RUN_DIR --name eagle3_short   # a finished default run as a study's opd arm
    python bench/study.py plateau --kind standalone --name standalone6 --set draft.num_layers=6 --tokens 370000
                                                     # --set: any override; a plateau's are kept and every arm gets them
    python -m draft_opd_ray.compare runs/study/eagle3/arms/*      # (eval runs it too)

1. plateau: `python -m draft_opd_ray.main stages=[sft]` on the first 768 ShareGPT train prompts' target answers
   (float32, cached by content: on a new machine the same command rebuilds them deterministically), for a budget
   of trained tokens with exports at every doubling (`sft.study.curve_tokens`). Each export's tau on the validation
   split (ShareGPT's held-out hash split: prompts no stage trains on) gives the curve; the rule, fixed before
   running: the curve has plateaued once the last doubling of training compute gained less than +0.02 tau. The
   last export is the branch point (cached in the run dir: the arms can be re-run later). Where runs/ was lost but
   the cache kept the finished warm start (a new checkout on the same machine), the same command finds it there,
   as `main` does, and copies it into the run dir as the branch point; the curve's exports are then not there.
2. arms, all from the branch point, at matched training FLOPs where the arm is SFT:
   opd           Draft-OPD with the defaults (`stages=[opd]`, rollouts on the train prompts after the 768)
   sft           SFT continued on the same answers (`sft.study.start_from`), `sft.study.max_flops` = the OPD run's training
                 FLOPs (student + replay target forwards; SFT is charged its target forward per batch), peak lr
                 = optim.lr (the OPD peak), the same warm-up + cosine shape
   sft_rollouts  `algorithm=sft_on_rollouts`: CE on the committed tokens of the same rollouts, no replay (C5)
   fkl, rkl      `algorithm=forward_kl`, `algorithm=reverse_kl` (C3)
   random        `anchor.policy=random replay.mode=redraft` (C4)
   Rollout verification FLOPs are logged (`flops_rollout`) and not counted, as SFT's answer generation is not.
   A seed changes the order of the OPD prompts and of the SFT batches.
3. eval: the branch point and every arm's final draft in one vLLM engine per prompt set (weights swapped in),
   greedy, K = 4; each arm's run dir gets `eval/report.json` (n, tau, 95% CI, per-prompt counts, the paired
   difference against the branch point) and `eval/curve.json`, then the comparison report (`compare/`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path("runs/study")
ARMS: dict[str, list[str]] = {
    "opd": ["stages=[opd]"],
    "sft": ["stages=[sft]"],
    "sft_rollouts": ["stages=[opd]", "algorithm=sft_on_rollouts"],
    "fkl": ["stages=[opd]", "algorithm=forward_kl"],
    "rkl": ["stages=[opd]", "algorithm=reverse_kl"],
    "random": ["stages=[opd]", "anchor.policy=random", "replay.mode=redraft"],
}
COMMON = ["sft.num_prompts=768", "sft.trajectory_dtype=float32", "wandb.mode=disabled"]
EVAL_K = 4  # drafted tokens per verification step in every evaluation (the study's K)
EVAL_SETS = {
    "validation": ("sharegpt", "eval"),
    "mtbench": ("mtbench", "all"),
    "humaneval": ("humaneval", "all"),
}


def study(args: argparse.Namespace) -> Path:
    """The study's folder: runs/study/<--name>, by default the draft kind's."""
    return ROOT / (args.name or args.kind)


def sh(args: list[str], log: Path) -> None:
    print("+", " ".join(args), flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:  # a resumed run's output follows the interrupted one's
        f.write("+ " + " ".join(args) + "\n")
        f.flush()
        r = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}), see {log}")


def run_or_resume(run_dir: Path, overrides: list[str], log: Path, common: list[str] | None = None) -> None:
    """Run ``main`` into ``run_dir``, or, where an earlier try left a complete checkpoint there (a session that
    stopped mid-run), continue it with ``resume=`` (its own config, from that checkpoint: docs/reliability.md)."""
    if any((run_dir / "checkpoints").glob("*/latest")):
        print(f"[study] {run_dir}: resuming from its last checkpoint", flush=True)
        sh([sys.executable, "-m", "draft_opd_ray.main", f"resume={run_dir}"], log)
    else:
        cmd = main_cmd(run_dir, overrides, COMMON if common is None else common)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "command").write_text(shown(cmd) + "\n")  # what results/ quotes, with the commit it ran at
        (run_dir / "commit").write_text(git_commit() + "\n")
        sh(cmd, log)


def main_cmd(run_dir: Path, overrides: list[str], common: list[str] = COMMON) -> list[str]:
    """The run's command line: ``common``, less any key the overrides set themselves (one value per key on it)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    common = [c for c in common if c.split("=", 1)[0] not in keys]
    return [sys.executable, "-m", "draft_opd_ray.main", *common, *overrides, f"hydra.run.dir={run_dir}"]


def shown(cmd: list[str]) -> str:
    """A command line as a reader would type it (`python`, not this interpreter's path)."""
    return " ".join(["python" if c == sys.executable else c for c in cmd])


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def checkpoints(run_dir: Path, stage: str) -> list[Path]:
    """The exported drafts of a stage, in training order."""
    found = (run_dir / "checkpoints" / stage).glob("step_*/draft")
    return sorted(found, key=lambda p: int(p.parent.name.split("_")[1]))


def training_flops(ckpt: Path) -> float:
    import torch

    state = torch.load(ckpt.parent / "training_state.pt", weights_only=True)
    f = state.get("flops", state)
    return float(f.get("flops_draft", 0.0)) + float(f.get("flops_target", 0.0))


def trained_tokens(ckpt: Path) -> int:
    import torch

    return int(torch.load(ckpt.parent / "training_state.pt", weights_only=True).get("tokens", 0))


def eval_prompts(name: str, n: int, target: str) -> list[list[int]]:
    from draft_opd_ray.data.prompts import prompt_ids

    source, split = EVAL_SETS[name]
    return prompt_ids(source, split, n, target)


def _stamp(draft: Path) -> str:
    """What identifies a draft's weights in the measurement cache: the sha256 of its weights file (a copy keeps
    its modification time, so the time would not tell a re-trained arm from the one measured)."""
    h = hashlib.sha256()
    with open(draft / "model.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_file(cache: Path, name: str, prompts: list[list[int]], max_new: int, target: str) -> Path:
    """The measurement cache of one setting: the set, its prompts' token ids (so a changed split or template is
    a new file, never a reuse), K, the answer length and the target's config."""
    config = Path(target) / "config.json"
    setting = {
        "prompts": prompts,
        "k": EVAL_K,
        "max_new_tokens": max_new,
        "target": config.read_text() if config.is_file() else str(target),
    }
    key = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:10]
    return cache / f"taus_{name}_n{len(prompts)}_t{max_new}_{key}.json"


def measure(
    target: str, kind: str, drafts: list[Path], sets: list[str], n: int, max_new: int, cache: Path
) -> dict[str, dict[str, Any]]:
    """{set: {draft: tau entry}} with one engine per set. Each draft's entry is kept in ``cache`` as soon as it is
    measured (`cache_file`: per set and setting, keyed by the draft's weights), and drafts found there are not
    measured again: an evaluation stopped mid-way (a session's end) continues where it stopped."""
    out = {}
    for s in sets:
        prompts = eval_prompts(s, n, target)
        out[s] = _measure_set(
            target, kind, drafts, s, prompts, max_new, cache_file(cache, s, prompts, max_new, target)
        )
    return out


def _measure_set(
    target: str, kind: str, drafts: list[Path], name: str, prompts: list[list[int]], max_new: int, path: Path
) -> dict[str, Any]:
    from draft_opd_ray.checkpoint import write_text_atomic
    from draft_opd_ray.eval.tau import measure_drafts

    kept = json.loads(path.read_text()) if path.is_file() else {}
    stamps = {str(d): _stamp(d) for d in drafts}  # before measuring: a file rewritten meanwhile is not cached
    have = {d: e["entry"] for d, e in kept.items() if d in stamps and e["stamp"] == stamps[d]}
    todo = [d for d in drafts if str(d) not in have]

    def keep(draft: str, entry: dict[str, Any]) -> None:
        kept[draft] = {"stamp": stamps[draft], "entry": entry}
        write_text_atomic(path, json.dumps(kept) + "\n")

    if todo:
        path.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"[eval] {name}: {len(todo)} drafts to measure, {len(drafts) - len(todo)} kept in {path}",
            flush=True,
        )
        have |= measure_drafts(
            target,
            kind,
            todo,
            prompts,
            num_speculative_tokens=EVAL_K,
            max_new_tokens=max_new,
            on_measured=keep,
        )
    return {str(d): have[str(d)] for d in drafts}


# ------------------------------------------------------------------------------------------------ plateau


def plateau(args: argparse.Namespace) -> None:
    run = study(args) / "plateau"
    budget = args.tokens
    marks = [budget >> i for i in range(args.doublings, 0, -1)]
    info: dict[str, Any] = {}
    if not (run / "plateau.json").is_file():  # written once the training has finished
        overrides = [
            "stages=[sft]",
            f"draft={args.kind}",
            f"sft.train_tokens={budget}",
            f"sft.study.curve_tokens=[{','.join(map(str, marks))}]",
            *args.set,
        ]
        run_or_resume(run, overrides, run / "sft.log")
    else:  # trained before: its overrides are what the checkpoints were made with
        info = _plateau_info(study(args))  # and the curve's verdict, once measured, kept
        saved = info.get("overrides", [])
        if args.set and args.set != saved:
            raise SystemExit(f"{run} was trained with --set {saved}, not {args.set}: use another --name")
        args.set = saved
    drafts = checkpoints(run, "sft")
    if not drafts:  # the run dir was lost (a new machine) but the cache kept the warm start: main reused it
        info |= {"branch": str(_branch_from_cache(run)), "overrides": args.set}
        (run / "plateau.json").write_text(json.dumps(info, indent=2) + "\n")
        return
    info |= {"branch": str(drafts[-1]), "overrides": args.set}
    trained = trained_tokens(drafts[-1])
    if trained < budget:  # a guard ended it first (sft.epochs): the curve's last step is then not a doubling
        print(
            f"[plateau] trained {trained:,} of --tokens {budget:,} tokens: sft.epochs ended it (see the log)"
        )
    info["trained_tokens"] = trained
    (run / "plateau.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"[plateau] branch point {drafts[-1]}; its curve is measured by `python bench/study.py eval`")


def _branch_from_cache(run: Path) -> Path:
    """The cached warm start that ``main`` reused for this plateau (its ``warm_start`` file), copied into the run
    dir as the branch point. Its curve's exports are not there: `--set sft.reuse=false` under another --name
    retrains them."""
    note = run / "warm_start"
    if not note.is_file():
        raise SystemExit(
            f"{run}: the run left no checkpoints/sft and reused no warm start, see {run}/sft.log"
        )
    cached = Path(note.read_text().strip())
    branch = run / "branch" / "draft"
    if not branch.is_dir():
        tmp = branch.with_name(".draft.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(cached, tmp)
        tmp.replace(branch)
    print(
        f"[plateau] {run} reused the cached warm start {cached} (the same settings trained it before): branch "
        f"point {branch}; the curve's exports are not in this run dir (`--set sft.reuse=false` under another "
        "--name retrains them)"
    )
    return branch


def plateau_curve(root: Path, taus: dict[str, dict[str, Any]]) -> None:
    """eval/curve.json of the plateau run (validation tau of every export) and the rule's verdict."""
    from draft_opd_ray.eval.stats import paired_diff

    run = root / "plateau"
    curve: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    drafts = checkpoints(run, "sft")
    for d in drafts:
        e = taus[str(d)]
        curve.append(
            {
                "draft": str(d),
                "tokens": trained_tokens(d),
                "flops": training_flops(d),
                "tau": e["tau"],
                "tau_ci": e["tau_ci"],
                "n": e["n"],
            }
        )
        if prev is not None:  # the gain over the export before, paired per prompt
            curve[-1]["paired_prev"] = paired_diff(e["per_prompt"], prev["per_prompt"])
        prev = e
    # the rule's span: the last export against the latest one at most half its trained tokens (a whole doubling,
    # or more; an export a guard such as sft.epochs made after the last mark is not compared with that mark alone)
    last = curve[-1]
    base = next((i for i in range(len(curve) - 2, -1, -1) if 2 * curve[i]["tokens"] <= last["tokens"]), None)
    gain = last["tau"] - curve[base]["tau"] if base is not None else math.nan
    verdict: dict[str, Any] = {
        "plateaued": bool(gain < 0.02),
        "last_doubling_gain": gain,
        "rule": "gain < +0.02 tau",
    }
    if base is not None:
        verdict["last_doubling_from"] = curve[base]["draft"]
        verdict["last_doubling_tokens"] = [curve[base]["tokens"], last["tokens"]]
        verdict["last_doubling_paired"] = paired_diff(
            taus[str(drafts[-1])]["per_prompt"], taus[str(drafts[base])]["per_prompt"]
        )
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / "curve.json").write_text(json.dumps(curve, indent=2) + "\n")
    info = {**_plateau_info(root), "branch": curve[-1]["draft"], **verdict}
    (run / "plateau.json").write_text(json.dumps(info, indent=2) + "\n")
    for c in curve:
        p = c.get("paired_prev")
        step = f"; paired vs the export before {p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" if p else ""
        print(
            f"[plateau] {c['flops']:.3g} FLOPs: tau {c['tau']:.3f} [{c['tau_ci'][0]:.3f}, {c['tau_ci'][1]:.3f}]"
            + step
        )
    span = verdict.get("last_doubling_tokens", [0, 0])
    print(
        f"[plateau] last doubling ({span[0]:,} -> {span[1]:,} tokens) {gain:+.3f}: "
        + ("plateaued" if verdict["plateaued"] else "NOT plateaued")
    )


def _plateau_info(root: Path) -> dict[str, Any]:
    info = root / "plateau" / "plateau.json"
    if not info.is_file():
        raise SystemExit(f"no {info}: run `python bench/study.py plateau` for this study first")
    return dict(json.loads(info.read_text()))


def branch_point(args: argparse.Namespace) -> Path:
    return Path(_plateau_info(study(args))["branch"])


def adopt(args: argparse.Namespace) -> None:
    """Take a finished ``stages=[sft,opd,...]`` run (e.g. the default `make run`) into a study: its SFT export is
    the branch point and its Draft-OPD run the ``opd`` arm of ``--seed`` (copied). The same arm from scratch:
    `plateau` with the run's SFT budget, then `arms --arms opd`."""
    run = Path(args.run_dir)
    sft, opd = checkpoints(run, "sft"), checkpoints(run, "opd")
    if not sft or not opd:
        raise SystemExit(f"{run}: needs both checkpoints/sft and checkpoints/opd (a stages=[sft,opd] run)")
    dest = arm_dir(args, "opd", args.seed)
    if dest.exists():
        raise SystemExit(f"{dest} exists")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # its eval/report.json too: τ on its eval set, paired against the branch point (its SFT export)
    shutil.copytree(run, dest)
    (dest / "arm").write_text("opd\n")
    info = study(args) / "plateau" / "plateau.json"
    info.parent.mkdir(parents=True, exist_ok=True)
    branch = dest / sft[-1].relative_to(run)
    # the answers its warm start was trained on: the arms continue on the same ones (`auto` resolved here, as in the
    # run, which is why an adopted study's arms run on a machine of the adopted run's kind)
    from omegaconf import OmegaConf

    from draft_opd_ray.device import resolve_dtype

    made = OmegaConf.load(run / ".hydra" / "config.yaml")
    answers = resolve_dtype(str(OmegaConf.select(made, "sft.trajectory_dtype", default="auto")))
    overrides = [f"sft.trajectory_dtype={answers}"]
    info.write_text(
        json.dumps({"branch": str(branch), "adopted_from": str(run), "overrides": overrides}, indent=2) + "\n"
    )
    print(f"[adopt] branch point {branch}; opd arm (seed {args.seed}) {dest}")


# ------------------------------------------------------------------------------------------------ arms


def arm_dir(args: argparse.Namespace, arm: str, seed: int) -> Path:
    return study(args) / "arms" / f"{arm}_s{seed}"


def final_draft(run: Path) -> Path | None:
    """The arm's last draft once the arm has finished (its ``arm`` file, written when the run exited cleanly);
    None for an arm not run or stopped mid-run (its checkpoints are where `arms` resumes it)."""
    if not (run / "arm").is_file():
        return None
    for stage in ("opd", "sft"):
        if (run / "checkpoints" / stage / "latest").exists():
            return checkpoints(run, stage)[-1]
    return None


def sft_continuation(branch: Path, opd_run: Path) -> list[str]:
    """The `sft` arm's overrides: SFT continued from ``branch`` on the same answers until the training FLOPs of the
    finished ``opd_run``, at the OPD peak lr (`optim.lr`): the same schedule shape from the same point."""
    from draft_opd_ray.config.schema import Config

    return [
        f"sft.study.start_from={branch}",
        f"sft.study.max_flops={training_flops(final_draft(opd_run))}",  # type: ignore[arg-type]
        "sft.train_tokens=null",
        "sft.epochs=1000",
        "sft.reuse=false",
        f"sft.lr={Config().optim.lr}",
    ]


def arms(args: argparse.Namespace) -> None:
    info = _plateau_info(study(args))
    branch = Path(info["branch"])
    # the plateau's own --set overrides (e.g. draft.num_layers=6) first: every arm runs with them
    common = [f"draft={args.kind}", *info.get("overrides", []), *args.set]
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            run = arm_dir(args, arm, seed)
            if final_draft(run) is not None:
                print(f"[arms] {run}: done")
                continue
            extra = [*common, f"seed={seed}", f"opd.steps={args.steps}", *ARMS[arm]]
            if arm == "sft":
                opd = arm_dir(args, "opd", seed)
                if final_draft(opd) is None:
                    raise SystemExit(f"the sft arm matches the FLOPs of {opd}: run the opd arm first")
                extra += sft_continuation(branch, opd)
            else:
                # a checkpoint every 5 steps: a session that stops mid-arm loses at most 5 steps (~15 min) of it
                extra += [f"draft.path={branch}", "opd.checkpoint_every=5"]
            run_or_resume(run, extra, run / "arm.log")
            (run / "arm").write_text(arm + "\n")


# ------------------------------------------------------------------------------------------------ controls

DEFAULT_COMMON = ["wandb.mode=disabled"]  # the default run's settings: nothing else is overridden
CONTROLS: dict[str, list[str]] = {
    "opd": ["stages=[opd]"],
    "sft": ["stages=[sft]"],
    "sft_rollouts": ["stages=[opd]", "algorithm=sft_on_rollouts"],
    "sft_rollouts_soft": ["stages=[opd]", "algorithm=sft_on_rollouts_soft"],
}


def default_branch(args: argparse.Namespace) -> Path:
    """The default run's warm start as the branch point: `stages=[sft]` with the default config and nothing else
    (``--set`` aside), which reuses the cached warm start where `make run` built one, else trains it."""
    info_path = study(args) / "plateau" / "plateau.json"
    if info_path.is_file():
        return Path(json.loads(info_path.read_text())["branch"])
    run = info_path.parent
    run_or_resume(run, ["stages=[sft]", *args.set], run / "sft.log", common=DEFAULT_COMMON)
    drafts = checkpoints(run, "sft")
    branch = drafts[-1] if drafts else _branch_from_cache(run)
    info = {"branch": str(branch), "overrides": args.set, "default_run": True}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return branch


def control_epochs(opd_run: Path, branch: Path, kind: str) -> tuple[int, float, float]:
    """(learner.epochs, FLOPs of one pass, the opd arm's FLOPs) for a control without replay at the Draft-OPD
    arm's training FLOPs. A control pays one target forward over each rollout a step (its features, or its
    teacher: the replay runs once whatever the epochs), then the student over every response position once per
    pass; greedy rollouts commit the target's own tokens whatever the draft, so the opd arm's rollouts of the same
    seed's prompts are the control's. Epochs = (opd FLOPs - the target forwards) / one pass, rounded."""
    import torch

    from draft_opd_ray.config.schema import Config
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.flops import target_forward_flops
    from draft_opd_ray.loop.opd import committed_items
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.models.target import read_target_info
    from draft_opd_ray.rollout.records import read_parquet
    from draft_opd_ray.wire import TeacherItem

    target = str(ensure_embedded_target())
    num_speculative_tokens = Config().draft.num_speculative_tokens
    student, info = draft_kind(kind).student(str(branch), target), read_target_info(target)
    records = [r for f in sorted((opd_run / "anchors").glob("*.parquet")) for r in read_parquet(f)]
    per_pass = once = 0.0
    for it in committed_items(records, num_speculative_tokens):
        n = len(it.anchor_pos)
        valid = torch.tensor([len(b) for b in it.drafted])
        ids = torch.tensor(it.input_ids)
        item = TeacherItem(
            ids,
            torch.zeros(0),
            torch.tensor(it.anchor_pos),
            torch.zeros(n, num_speculative_tokens, dtype=torch.long),
            valid,
            valid,
            valid,
            None,
            0,
        )
        per_pass += student.flops(item)
        once += target_forward_flops(info, 1, len(ids))
    opd = training_flops(final_draft(opd_run))  # type: ignore[arg-type]
    return control_pass_count(opd, once, per_pass), per_pass, opd


def control_pass_count(opd_flops: float, target_once: float, student_pass: float) -> int:
    """The passes that bring ``target_once + passes * student_pass`` closest to ``opd_flops`` (at least one)."""
    return max(1, round((opd_flops - target_once) / student_pass))


def controls(args: argparse.Namespace) -> None:
    """The default run's claim as a controlled comparison: from the default warm start, Draft-OPD with the defaults
    and three controls at its training FLOPs (SFT continued on the warm start's answers; hard and soft labels on
    the committed tokens of the same kind of rollouts, no replay), each for ``--seeds``."""
    branch = default_branch(args)
    for seed in [int(x) for x in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            run = arm_dir(args, arm, seed)
            if final_draft(run) is not None:
                print(f"[controls] {run}: done")
                continue
            extra = [f"draft={args.kind}", *args.set, f"seed={seed}", *CONTROLS[arm]]
            opd = arm_dir(args, "opd", seed)
            if arm != "opd" and final_draft(opd) is None:
                raise SystemExit(f"the {arm} arm trains at the FLOPs of {opd}: run the opd arm first")
            if arm == "sft":
                extra += sft_continuation(branch, opd)
            else:
                extra += [f"draft.path={branch}", "opd.checkpoint_every=5"]
            if arm.startswith("sft_rollouts"):
                epochs, per_pass, target_flops = control_epochs(opd, branch, args.kind)
                print(
                    f"[controls] {arm} seed {seed}: {per_pass:.3g} student FLOPs a pass over the opd arm's rollouts, "
                    f"{target_flops:.3g} to match: learner.epochs={epochs}",
                    flush=True,
                )
                extra.append(f"learner.epochs={epochs}")
            run_or_resume(run, extra, run / "arm.log", common=DEFAULT_COMMON)
            (run / "arm").write_text(arm + "\n")


# ------------------------------------------------------------------------------------------------ eval


def evaluate_arms(args: argparse.Namespace) -> None:
    """Measure the branch point and the arms matching ``--only`` (every checkpoint of each: its tau-vs-FLOPs
    curve), write each measured arm's report and curve, then compare every arm that has a report."""
    from draft_opd_ray.models.embedded import ensure_embedded_target

    branch = branch_point(args)
    arms_dir = study(args) / "arms"
    runs = sorted(p for p in arms_dir.glob(args.only) if final_draft(p) is not None)
    ckpts = {r: checkpoints(r, "opd") or checkpoints(r, "sft") for r in runs}
    if args.last:  # the final drafts only, no curve: one measurement per arm
        ckpts = {r: c[-1:] for r, c in ckpts.items()}
    drafts = [branch] + [d for r in runs for d in ckpts[r]]
    target = str(ensure_embedded_target())
    sets = args.sets.split(",")
    exports = [d for d in checkpoints(study(args) / "plateau", "sft") if d != branch] if args.exports else []
    taus: dict[str, dict[str, Any]] = {}
    for s in sets:  # the plateau's other exports ride along on the validation set
        extra = exports if s == "validation" else []
        taus |= measure(
            target,
            args.kind,
            [*drafts, *extra],
            [s],
            args.eval_prompts,
            args.max_new_tokens,
            study(args) / "eval",
        )
    if "validation" in sets and exports:
        plateau_curve(study(args), taus["validation"])
    for run in runs:
        _arm_report(run, branch, ckpts[run], target, sets, taus)
    _compare_all(args, sets)


def _arm_report(
    run: Path, branch: Path, ckpts: list[Path], target: str, sets: list[str], taus: dict[str, dict[str, Any]]
) -> None:
    """eval/report.json (the final draft on every set, paired against the branch point) and eval/curve.json
    (tau on the first set at the branch point and at every checkpoint, by training FLOPs)."""
    from draft_opd_ray.eval.stats import paired_diff

    draft = ckpts[-1]
    report: dict[str, Any] = {
        "target": target,
        "draft": str(draft),
        "draft_before": str(branch),
        "datasets": {},
    }
    for s in sets:
        before, after = taus[s][str(branch)], taus[s][str(draft)]
        entry = dict(after)
        entry["before"] = before
        entry["paired"] = {"before": paired_diff(after["per_prompt"], before["per_prompt"])}
        report["datasets"][s] = entry
    (run / "eval").mkdir(exist_ok=True)
    (run / "eval" / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    first = taus[sets[0]]
    curve = [{"flops": 0.0, "tau": first[str(branch)]["tau"], "n": first[str(branch)]["n"]}]
    for d in ckpts:
        e = first[str(d)]
        curve.append(
            {
                "flops": training_flops(d),
                "tau": e["tau"],
                "n": e["n"],
                "checkpoint": d.parent.name,
                "paired_before": paired_diff(e["per_prompt"], first[str(branch)]["per_prompt"]),
            }
        )
    (run / "eval" / "curve.json").write_text(json.dumps(curve, indent=2) + "\n")


def _compare_all(args: argparse.Namespace, sets: list[str]) -> None:
    from draft_opd_ray.compare import run_compare

    arms_dir = study(args) / "arms"
    reported = sorted(str(p) for p in arms_dir.glob("*_s*") if (p / "eval" / "report.json").is_file())
    if not reported:  # the plateau's curve alone (no arm run yet)
        return
    for s in sets:
        have = [
            r for r in reported if s in json.loads((Path(r) / "eval" / "report.json").read_text())["datasets"]
        ]
        run_compare(have, out=study(args) / "compare" / s, dataset=s, baseline=args.baseline)


# ------------------------------------------------------------------------------------------------ export


def export(args: argparse.Namespace) -> None:
    """The study's measurements as small files under ``--to`` (results/<study>/, committed; `results/README.md`):
    per set, the branch point and every finished arm's final draft, per prompt (verification steps, accepted
    tokens), with the arm's training FLOPs, trained tokens, command and commit. `python -m draft_opd_ray.compare
    results/<study>` recomputes every table from them."""
    from draft_opd_ray.checkpoint import write_text_atomic
    from draft_opd_ray.models.embedded import ensure_embedded_target

    out = Path(args.to)
    branch = branch_point(args)
    target = str(ensure_embedded_target())
    runs = sorted(p for p in (study(args) / "arms").glob("*_s*") if final_draft(p) is not None)
    primary = None
    if args.primary:
        pset, parm, pbase = args.primary.split(":")
        primary = {"set": pset, "arm": parm, "baseline": pbase}
    meta = {"name": out.name, "question": args.question, "primary": primary, "baseline": args.baseline}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "study.json", json.dumps(meta, indent=2) + "\n")
    for s in args.sets.split(","):
        prompts = eval_prompts(s, args.eval_prompts, target)
        path = cache_file(study(args) / "eval", s, prompts, args.max_new_tokens, target)
        kept = json.loads(path.read_text()) if path.is_file() else {}
        rows = [("branch", None, branch, None)] + [
            (r.name.rsplit("_s", 1)[0], int(r.name.rsplit("_s", 1)[1]), final_draft(r), r) for r in runs
        ]
        for arm, seed, draft, run in rows:
            entry = kept.get(str(draft))
            if entry is None:
                print(f"[export] {s}: {draft} not measured yet (`eval --last`), left out")
                continue
            if entry["stamp"] != _stamp(draft):  # type: ignore[arg-type]
                raise SystemExit(
                    f"[export] {s}: {draft}'s weights changed since they were measured: run `eval` again"
                )
            label = "branch" if seed is None else f"{arm}_s{seed}"
            rec = {
                "arm": arm,
                "seed": seed,
                "set": s,
                "k": EVAL_K,
                "max_new_tokens": args.max_new_tokens,
                "flops": training_flops(draft) if run is not None else None,  # type: ignore[arg-type]
                "tokens": trained_tokens(draft) if run is not None else None,  # type: ignore[arg-type]
                "command": _read(run or branch.parent, "command"),
                "eval_command": f"python bench/study.py eval --name {study(args).name} --sets {args.sets} "
                f"--eval-prompts {args.eval_prompts} --last",
                "commit": _read(run or branch.parent, "commit"),
                "draft": label,
                "prompts": [
                    {"key": str(i), "steps": int(c["steps"]), "accepted": int(c["accepted"])}
                    for i, c in enumerate(entry["entry"]["per_prompt"])
                ],
            }
            (out / s).mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / s / f"{label}.json", json.dumps(rec) + "\n")
            print(f"[export] {out / s / label}.json: tau {entry['entry']['tau']:.3f}")


def _read(run: Path, name: str) -> str:
    """A run dir's `command` / `commit` file (written when the study started it); for a branch point reused from
    the cache, its plateau run's."""
    for d in (run, *run.parents):
        f = d / name
        if f.is_file():
            return f.read_text().strip()
        if d.name == "plateau":
            break
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plateau")
    p.add_argument("--tokens", type=int, default=1_280_000, help="SFT budget in trained tokens")
    p.add_argument("--doublings", type=int, default=4, help="exports at budget/2, /4, ...")
    a = sub.add_parser("arms")
    for q in (p, a):
        q.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a config override (repeatable); the plateau's are kept in plateau.json and every arm gets them",
        )
    a.add_argument("--arms", default="opd,sft,sft_rollouts")
    a.add_argument("--seeds", default="0")
    a.add_argument("--steps", type=int, default=30, help="Draft-OPD learner steps of the opd-loop arms")
    e = sub.add_parser("eval")
    e.add_argument("--sets", default="validation,mtbench,humaneval")
    e.add_argument("--eval-prompts", type=int, default=40)
    e.add_argument("--baseline", default="sft")
    e.add_argument("--only", default="*_s*", help="the arm run dirs to measure (a glob under arms/)")
    e.add_argument(
        "--exports", action="store_true", help="also the plateau's exports (its curve, validation)"
    )
    e.add_argument("--last", action="store_true", help="each arm's final draft only (no tau-vs-FLOPs curve)")
    c = sub.add_parser("controls")
    c.add_argument("--arms", default="opd,sft,sft_rollouts,sft_rollouts_soft")
    c.add_argument("--seeds", default="0")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    x = sub.add_parser("export")
    x.add_argument("--to", required=True, help="the results dir (results/<study>)")
    x.add_argument("--sets", default="validation,mtbench")
    x.add_argument("--eval-prompts", type=int, default=80)
    x.add_argument("--question", default="")
    x.add_argument("--primary", default=None, help="SET:ARM:BASELINE, the study's declared primary endpoint")
    x.add_argument("--baseline", default="sft")
    d = sub.add_parser("adopt")
    d.add_argument("run_dir", help="a finished stages=[sft,opd,...] run dir")
    d.add_argument("--seed", type=int, default=0)
    for q in (p, a, e, d, c, x):
        q.add_argument("--kind", default="eagle3")
        q.add_argument("--name", default=None, help="the study's folder under runs/study (default: --kind)")
        q.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    commands = {"plateau": plateau, "arms": arms, "eval": evaluate_arms, "adopt": adopt, "controls": controls}
    commands["export"] = export
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
