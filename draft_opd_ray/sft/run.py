"""End-to-end SFT of a draft on this machine: trajectories -> training -> vLLM tau (P0 and the other kinds).

    python -m draft_opd_ray.sft.run --run-dir runs/sft --minutes 40 --num-prompts 1536
    python -m draft_opd_ray.sft.run --kind standalone --num-layers 20 --run-dir runs/sa --minutes 30

Stages (``--stages data,train,eval``): ``data`` generates/reuses cached target trajectories for ShareGPT train
prompts; ``train`` runs :func:`draft_opd_ray.sft.trainer.run_sft`; ``eval`` serves each exported checkpoint
(and vLLM's ``ngram``) at K on held-out MT-Bench prompts and writes ``eval/p0.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from draft_opd_ray.config.schema import PromptSetConfig
from draft_opd_ray.data.prompts import load_prompt_set
from draft_opd_ray.models.target import default_cache_dir, ensure_embedded_target


def prompt_ids(source: str, split: str, n: int, target: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    ps = load_prompt_set(PromptSetConfig(source=source, split=split, max_prompts=n), tok)
    return [list(p.token_ids) for p in ps.prompts]


def measure_tau(
    target: Path,
    drafts: Sequence[Path],
    prompts: Sequence[Sequence[int]],
    k: int,
    max_new_tokens: int,
    ngram: bool = True,
    kind: str = "eagle3",
) -> dict[str, dict[str, float]]:
    """tau (vLLM's counters and the anchor records) of vLLM's ngram and of each ``kind`` draft, greedy, at K=k.

    The drafts share one engine: after the first, each is swapped in with ``load_draft_weights``."""
    from safetensors.torch import load_file

    from draft_opd_ray.rollout.engine import Sampling, SpecDecodeEngine
    from draft_opd_ray.rollout.records import tau, tau_vllm

    sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=(2,))
    out: dict[str, dict[str, float]] = {}

    def run(engine: SpecDecodeEngine, name: str) -> None:
        tic = time.monotonic()
        recs = engine.generate(prompts, sampling)
        n = sum(len(r.response_ids) for r in recs)
        out[name] = {
            "tau_vllm": tau_vllm(recs),
            "tau": tau(recs),
            "tokens": n,
            "wall_s": time.monotonic() - tic,
        }
        print(
            f"{name}: tau_vllm {out[name]['tau_vllm']:.3f} tau {out[name]['tau']:.3f} ({n} tokens)",
            flush=True,
        )

    runs: list[tuple[str, list[Path | None]]] = [("ngram", [None] if ngram else []), (kind, list(drafts))]
    for kind, paths in runs:
        if not paths:
            continue
        engine = SpecDecodeEngine(
            target, draft_kind=kind, draft_path=paths[0], num_speculative_tokens=k, max_model_len=2048
        )
        try:
            for v, p in enumerate(paths):
                if v > 0:
                    assert p is not None
                    engine.load_draft_weights(load_file(str(Path(p) / "model.safetensors")), v)
                run(engine, "ngram" if p is None else str(p))
        finally:
            engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/sft"))
    ap.add_argument("--stages", default="data,train,eval")
    ap.add_argument("--num-prompts", type=int, default=1536)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument(
        "--dataset-answers",
        type=int,
        default=0,
        help="data: add this many ShareGPT answers scored by the target (after the first --train-prompts)",
    )
    ap.add_argument(
        "--traj-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="vLLM precision for the answers",
    )
    ap.add_argument(
        "--first-float32", type=int, default=0, help="data: the first N answers in float32 anyway"
    )
    ap.add_argument("--train-prompts", type=int, default=2560, help="data.train.max_prompts of the main run")
    ap.add_argument("--trajectories", type=Path, default=None, help="default: the cached data stage output")
    ap.add_argument("--minutes", type=float, default=40.0, help="budget: feature building + training")
    ap.add_argument("--curve", default="5,10,20", help="extra checkpoint exports at these budget minutes")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--kind", default="eagle3", choices=("eagle3", "standalone", "dflash"))
    ap.add_argument("--num-layers", type=int, default=None, help="standalone/dflash draft layers")
    ap.add_argument("--block-size", type=int, default=8, help="dflash block size (K = block size - 1)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=4)
    ap.add_argument("--aux-layers", default="", help="comma-separated target layer ids (default: 2,L/2,L-3)")
    ap.add_argument("--init", default="target", choices=("target", "random"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--eval-prompts", type=int, default=40)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument(
        "--drafts", default="", help="eval only: comma-separated draft folders (default: the run's)"
    )
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--start-from", type=Path, default=None, help="train: continue from this exported draft")
    ap.add_argument("--max-flops", type=float, default=None, help="train: stop at this many training FLOPs")
    ap.add_argument("--eval-name", default="p0", help="eval/<name>.json")
    ap.add_argument("--no-ngram", action="store_true", help="eval: skip vLLM's ngram reference")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: 8x faster than 2 on a shared 2-core box)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    torch.set_num_threads(args.threads)
    target = ensure_embedded_target()
    stages = args.stages.split(",")
    if "data" in stages:
        from draft_opd_ray.sft.data import generate_trajectories

        prompts = prompt_ids("sharegpt", "train", args.num_prompts, target)
        n32 = len(prompts) if args.traj_dtype == "float32" else min(args.first_float32, len(prompts))
        parts = []  # the first n32 answers in float32, the rest in --traj-dtype
        if n32:
            parts.append(
                generate_trajectories(
                    target, prompts[:n32], default_cache_dir(), max_new_tokens=args.max_new_tokens
                )
            )
        if n32 < len(prompts):
            parts.append(
                generate_trajectories(
                    target,
                    prompts[n32:],
                    default_cache_dir(),
                    max_new_tokens=args.max_new_tokens,
                    dtype=args.traj_dtype,
                )
            )
        path = parts[0]
        if len(parts) > 1:
            from draft_opd_ray.sft.data import mix_trajectories, read_trajectories

            path = mix_trajectories(parts[0], read_trajectories(parts[1]), default_cache_dir())
        if args.dataset_answers:
            from transformers import AutoTokenizer

            from draft_opd_ray.config.schema import Config, DataConfig, SFTConfig
            from draft_opd_ray.sft.data import answer_trajectories, mix_trajectories
            from draft_opd_ray.sft.stage import dataset_answers

            tok = AutoTokenizer.from_pretrained(str(target))
            cfg = Config(
                data=DataConfig(train=PromptSetConfig(source="sharegpt", split="train")),
                sft=SFTConfig(dataset_answers=args.dataset_answers),
            )
            extra = dataset_answers(cfg, tok, skip=args.train_prompts)
            rows = answer_trajectories(
                [p.token_ids for p in extra],
                [p.meta["answer"] for p in extra],
                tok,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=tok.eos_token_id,
            )
            path = mix_trajectories(path, rows, default_cache_dir())
        print(f"trajectories: {path}")
        args.trajectories = args.trajectories or path
    if "train" in stages:
        from draft_opd_ray.config.schema import DraftConfig, LearnerConfig, OptimConfig, SFTConfig
        from draft_opd_ray.sft.trainer import run_sft

        if args.trajectories is None:
            raise SystemExit("--trajectories is needed without the data stage")
        draft = run_sft(
            target,
            args.trajectories,
            args.run_dir,
            sft=SFTConfig(
                epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, time_budget_min=args.minutes
            ),
            draft=DraftConfig(
                kind=args.kind,
                **({"num_layers": args.num_layers} if args.num_layers else {}),
                block_size=args.block_size,
                draft_vocab_size=args.draft_vocab,
                ttt_steps=args.ttt_steps,
                aux_layer_ids=[int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None,
            ),
            optim=OptimConfig(warmup_ratio=0.03, schedule="cosine", weight_decay=0.0, grad_clip=1.0),
            learner=LearnerConfig(zero_stage=args.zero_stage, dtype=args.dtype),
            cache_dir=default_cache_dir(),
            init=args.init,
            checkpoint_minutes=[float(m) for m in args.curve.split(",") if m],
            resume=args.resume,
            start_from=args.start_from,
            max_flops=args.max_flops,
        )
        print(f"draft: {draft}")
    if "eval" in stages:
        root = args.run_dir / "checkpoints" / "sft"
        drafts = [Path(d) for d in args.drafts.split(",") if d] or sorted(
            (d / "draft" for d in root.glob("step_*")), key=lambda d: int(d.parent.name.split("_")[1])
        )
        prompts = prompt_ids("mtbench", "all", args.eval_prompts, target)
        res = measure_tau(
            target, drafts, prompts, args.k, args.max_new_tokens, ngram=not args.no_ngram, kind=args.kind
        )
        (args.run_dir / "eval").mkdir(parents=True, exist_ok=True)
        (args.run_dir / "eval" / f"{args.eval_name}.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
