"""τ of one exported draft through vLLM and through the PyTorch reference engine, on the same prompts, greedy.

    python -m draft_opd_ray.eval.tau_match --kind eagle3 --draft <draft folder> --prompts 8 --max-new-tokens 128

Both engines run lossless greedy speculative decoding with the same K: vLLM serves the exported folder through
its own speculative_config (τ from its per-request counters), the reference engine
(`draft_opd_ray.rollout.reference`) loads the same folder with this project's loaders (τ from its records).
The two agree when the export is faithful; near-ties of the fp32 argmax can still split a few sequences, so the
script also reports how many responses are token-identical. Writes ``--out`` (JSON).
The reference engine recomputes the whole sequence at each step (no KV cache): keep prompts and tokens small.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from draft_opd_ray.drafts.registry import KINDS, draft_kind
from draft_opd_ray.eval.tau import measure, tau_stats


def tau_match(
    target_dir: str | Path,
    kind: str,
    draft_dir: str | Path,
    prompts: Sequence[list[int]],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """{"tau_vllm", "tau_reference", "ratio", "identical", ...} for one draft on ``prompts``; answers stop at
    ``stop_token_ids`` (None: the target's eos ids, `models.target.stop_token_ids`)."""
    from transformers import AutoModelForCausalLM

    from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.models.target import target_stop_token_ids
    from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine
    from draft_opd_ray.rollout.reference import speculative_generate

    stop = tuple(stop_token_ids) if stop_token_ids is not None else target_stop_token_ids(target_dir)
    tic = time.monotonic()
    engine = SpecDecodeEngine(
        EngineRun(target_dir, kind, draft_dir),
        DraftConfig(kind=kind, num_speculative_tokens=num_speculative_tokens),
        TargetConfig(max_model_len=2048),
        RolloutConfig(),
    )
    try:
        served_stats, served = measure(
            engine, prompts, Sampling(max_new_tokens=max_new_tokens, stop_token_ids=stop)
        )
        spec = engine.spec_config
    finally:
        engine.shutdown()
    vllm_s = time.monotonic() - tic

    tic = time.monotonic()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    drafter = draft_kind(kind).drafter(target, draft_dir, target_dir)
    ref = speculative_generate(
        target,
        drafter,
        prompts,
        num_speculative_tokens=num_speculative_tokens,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop,
    )
    ref_s = time.monotonic() - tic
    tv, tr = served_stats["tau_vllm"], tau_stats(ref)["tau"]
    return {
        "kind": kind,
        "draft": str(draft_dir),
        "speculative_config": spec,
        "k": num_speculative_tokens,  # the key stays "k" (the results files written by --out)
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "tau_vllm": tv,
        "tau_vllm_records": served_stats["tau"],
        "tau_reference": tr,
        "ratio": tv / tr,
        "identical": sum(a.response_ids == b.response_ids for a, b in zip(served, ref)),
        "tokens_vllm": sum(len(r.response_ids) for r in served),
        "tokens_reference": sum(len(r.response_ids) for r in ref),
        "vllm_s": vllm_s,
        "reference_s": ref_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", required=True, choices=tuple(KINDS))
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="default: 4 (a block drafter: its block size - 1)",
    )
    ap.add_argument("--prompts", type=int, default=8, help="held-out MT-Bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from draft_opd_ray.data.prompts import prompt_ids
    from draft_opd_ray.models.embedded import ensure_embedded_target

    target = ensure_embedded_target()
    num_speculative_tokens = args.num_speculative_tokens
    if num_speculative_tokens is None:
        block = json.loads((args.draft / "config.json").read_text()).get("block_size")
        num_speculative_tokens = (
            int(block) - 1 if block else 4
        )  # a block drafter proposes block_size - 1 tokens
    prompts = prompt_ids("mtbench", "all", args.prompts, target)
    res = tau_match(
        target,
        args.kind,
        args.draft,
        prompts,
        num_speculative_tokens=num_speculative_tokens,
        max_new_tokens=args.max_new_tokens,
    )
    print(json.dumps(res, indent=2), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
