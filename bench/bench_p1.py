"""P1: Draft-OPD vs SFT continued from the same warm start for the same training FLOPs (docs/benchmarks.md).

    python bench/bench_p1.py --warm-start RUN/checkpoints/sft/step_N/draft --steps 20 --run-dir runs/p1 \\
        [--opd-override loss.gamma=0.8 ...]
    python bench/bench_p1.py --warm-start WARM --opd-run RUN --run-dir runs/p1   # OPD arm from a finished run

1. Draft-OPD: `python -m draft_opd_ray.main stages=[opd] draft.path=<warm start>` for --steps learner steps
   (2 vLLM rollout workers, a replay actor and a DeepSpeed learner on local Ray). Its training FLOPs F are read
   from metrics.jsonl: the student forward + backward (`flops_draft`) and the target forwards of replay
   (`flops_target`). The rollouts' verification forwards are reported beside (`flops_rollout`), not counted,
   as SFT's trajectory generation is not either.
2. SFT continued: `python -m draft_opd_ray.main stages=[sft] sft.study.start_from=<warm start> sft.study.max_flops=F` on the SFT
   trajectories (ShareGPT train prompts, target's greedy answers), same TTT loss as the warm start; each answer's
   target forward is charged once, where first used (`sft.trainer.target_charge`), so both arms pay for the
   target.
3. τ of the warm start, the SFT arm and the OPD arm through vLLM at K on the same held-out MT-Bench prompts
   (greedy, one engine, weights swapped in): P1 = τ(OPD) / τ(SFT), vLLM's counters.
Writes <run-dir>/p1.json and prints one line for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from draft_opd_ray.checkpoint import latest_folder
from draft_opd_ray.data.prompts import prompt_ids
from draft_opd_ray.eval.tau import measure_drafts
from draft_opd_ray.models.embedded import ensure_embedded_target


def sh(args: list[str], log: Path) -> None:
    print("+", " ".join(args), flush=True)
    with log.open("w") as f:
        r = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}), see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm-start", type=Path, required=True)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/p1"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=3e-4, help="both arms")
    ap.add_argument("--sft-batch-tokens", type=int, default=2048)
    ap.add_argument("--sft-prompts", type=int, default=768)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--opd-override", nargs="*", default=[])
    ap.add_argument("--skip", default="", help="comma list of arms already done: opd,sft")
    ap.add_argument(
        "--opd-run",
        type=Path,
        default=None,
        help="use the opd stage of this run directory as the OPD arm (its draft.path must be --warm-start)",
    )
    args = ap.parse_args()
    rd = args.run_dir.resolve()
    rd.mkdir(parents=True, exist_ok=True)
    warm = args.warm_start.resolve()
    cfg = json.loads((warm / "config.json").read_text())
    aux = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    skip = set(args.skip.split(","))

    opd_dir = args.opd_run.resolve() if args.opd_run else rd / "opd"
    if "opd" not in skip and args.opd_run is None:
        sh(
            [
                sys.executable,
                "-m",
                "draft_opd_ray.main",
                "stages=[opd]",
                f"draft.path={warm}",
                f"draft.draft_vocab_size={cfg['draft_vocab_size']}",
                f"draft.aux_layer_ids=[{','.join(map(str, aux))}]",
                f"opd.steps={args.steps}",
                f"opd.checkpoint_every={args.steps}",
                f"optim.lr={args.lr}",
                "wandb.mode=disabled",
                f"hydra.run.dir={opd_dir}",
                *args.opd_override,
            ],
            rd / "opd.log",
        )
    rows = [json.loads(x) for x in (opd_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("stage") == "opd" and "flops_draft" in r][-1]
    budget = last["flops_draft"] + last["flops_target"]
    opd_draft = latest_folder(opd_dir / "checkpoints" / "opd")
    if opd_draft is None:
        raise SystemExit(f"{opd_dir}: no opd checkpoint")

    sft_dir = rd / "sft"
    if "sft" not in skip:
        sh(
            [
                sys.executable,
                "-m",
                "draft_opd_ray.main",
                "stages=[sft]",
                f"sft.study.start_from={warm}",
                f"sft.study.max_flops={budget}",
                f"sft.num_prompts={args.sft_prompts}",
                "sft.trajectory_dtype=float32",
                "sft.train_tokens=null",
                "sft.epochs=100",  # the FLOPs budget ends it (one epoch of 768 answers is ~1.2e14 FLOPs)
                "sft.reuse=false",
                f"sft.lr={args.lr}",
                f"sft.batch_tokens={args.sft_batch_tokens}",
                "optim.warmup_ratio=0.03",
                f"draft.ttt_steps={args.ttt_steps}",
                f"draft.draft_vocab_size={cfg['draft_vocab_size']}",
                f"draft.aux_layer_ids=[{','.join(map(str, aux))}]",
                "wandb.mode=disabled",
                f"hydra.run.dir={sft_dir}",
            ],
            rd / "sft.log",
        )
    srows = [json.loads(x) for x in (sft_dir / "metrics.jsonl").read_text().splitlines()]
    strain = [r for r in srows if "flops_draft" in r][-1]
    sft_root = sft_dir / "checkpoints" / "sft"
    sft_draft = max(sft_root.glob("step_*"), key=lambda d: int(d.name.split("_")[1])) / "draft"

    drafts = [warm, sft_draft, opd_draft / "draft"]
    target = ensure_embedded_target()
    prompts = prompt_ids("mtbench", "all", args.eval_prompts, target)
    taus = measure_drafts(
        target,
        "eagle3",
        drafts,
        prompts,
        num_speculative_tokens=args.num_speculative_tokens,
        max_new_tokens=256,
    )
    t_warm, t_sft, t_opd = (taus[str(d)]["tau_vllm"] for d in drafts)
    out = {
        "P1": t_opd / t_sft,
        "tau_warm_start": t_warm,
        "tau_sft_continued": t_sft,
        "tau_opd": t_opd,
        "flops_budget": budget,
        "opd": {k: last[k] for k in ("step", "flops_draft", "flops_target", "flops_rollout")},
        "sft": {
            "steps": strain["step"],
            "flops_draft": strain["flops_draft"],
            "flops_target": strain["flops_target"],
        },
    }
    (rd / "p1.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    print(
        f"P1 {t_opd / t_sft:.3f} (tau after Draft-OPD {t_opd:.3f} / after SFT continued {t_sft:.3f}; warm start "
        f"{t_warm:.3f}; {budget:.3g} training FLOPs each: OPD {last['step']} steps, SFT {strain['step']} steps)"
    )


if __name__ == "__main__":
    main()
