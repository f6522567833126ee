"""P9: one Draft-OPD step with the teacher captured in the verification pass ÷ the same step with the replay's target
forward, on the same records.

    python bench/bench_verify_step.py                          # 16 MT-Bench prompts x 128 tokens, 5 repeats
    python bench/bench_verify_step.py --prompts 32 --repeats 7

Writes results/bench/P9.json (`--out`; format: results/README.md).

The records come from one vLLM rollout of the default config's warm start (EAGLE-3, cached, or trained by the sft
stage as `check_teacher` does) with verify-pass capture on; `loop.opd.replay_items` selects the default anchors.
A step is what the OPD loop runs after the rollout: the replay actor's `score` and one learner update
(`opd/learner.py`, DeepSpeed on CPU). The two sources run on the same items, interleaved, each with its own replay
actor as the loop would build it from `teacher.source`:

    verify   the captured top-k and tail, and EAGLE-3's feature rows captured with them: the replay runs no target;
    replay   the packed tree-masked target forward over sequence + branches, and the draft's own top-m
             (`loss.draft_topm`, the default) from the replay's draft copy.

P9 = median(verify step) / median(replay step). The replay share alone and the target FLOPs of each are beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import add_result_args, write_result


def _rollout(cfg, target: str, draft: str, prompts: list[list[int]], stop, max_new_tokens: int):  # noqa: ANN001, ANN202
    from draft_opd_ray.loop.actors import capture_settings
    from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine, all_cores

    topk, vocab, features = capture_settings(cfg, target, draft)
    engine = SpecDecodeEngine(
        EngineRun(
            target,
            cfg.draft.kind,
            draft,
            cpu_bind=all_cores(),
            capture_topk=topk,
            capture_vocab=vocab,
            capture_features=features,
        ),
        cfg.draft,
        cfg.target,
        cfg.rollout,
    )
    sampling = Sampling(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=max_new_tokens,
        seed=cfg.seed,
        stop_token_ids=tuple(stop),
    )
    try:
        return [r for r in engine.generate(prompts, sampling) if not r.error]
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench prompts rolled out")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5, help="interleaved steps per source")
    add_result_args(ap)
    args = ap.parse_args()

    import torch

    from draft_opd_ray.check_teacher import _draft_folder
    from draft_opd_ray.config.schema import PromptSetConfig
    from draft_opd_ray.config.store import compose
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.driver import load_prompts, prepare_target
    from draft_opd_ray.flops import target_forward_flops
    from draft_opd_ray.loop.opd import replay_items
    from draft_opd_ray.models.target import stop_token_ids
    from draft_opd_ray.opd.learner import Learner, LearnerRun
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun
    from draft_opd_ray.wire import TeacherSummary

    cfg = compose([])
    target, tokenizer, info = prepare_target(cfg)
    stop = stop_token_ids(info, tokenizer)
    prompts = load_prompts(
        cfg, tokenizer, PromptSetConfig(source="mtbench", split="all", max_prompts=args.prompts)
    )
    with tempfile.TemporaryDirectory(prefix="bench_p9_") as tmp:
        draft = _draft_folder(cfg, target, load_prompts(cfg, tokenizer, "train"), stop, Path(tmp))
    records = _rollout(cfg, target, draft, prompts, stop, args.max_new_tokens)
    items = replay_items(records, cfg, seed=cfg.anchor.seed)
    if not items or any(it.captured is None for it in items):
        sys.exit("bench_verify_step: the rollout gave no anchors, or a record without its captured teacher")
    plain = [dataclasses.replace(it, captured=None) for it in items]
    anchors = sum(len(it.anchor_pos) for it in items)
    print(f"[P9] {len(records)} records, {len(items)} sequences, {anchors} anchors", flush=True)

    features, draft_ids = draft_kind(cfg.draft.kind).replay_needs(draft, target)
    threads = torch.get_num_threads()
    actors = {}
    for source in ("verify", "replay"):
        teacher = dataclasses.replace(cfg.teacher, source=source)
        run = ReplayRun(target, features, draft_ids, draft, num_threads=threads)
        actors[source] = ReplayActor(run, cfg.draft, teacher, cfg.loss, cfg.replay)
    learner = Learner(
        LearnerRun(draft, target, total_steps=2 * args.repeats + 2),
        cfg.draft,
        cfg.loss,
        cfg.optim,
        cfg.learner,
    )
    batches = {"verify": items, "replay": plain}
    times: dict[str, dict[str, list[float]]] = {s: {"replay": [], "learner": [], "step": []} for s in batches}
    flops: dict[str, float] = {}
    for rep in range(args.repeats + 1):  # the first round warms both up and is not counted
        for source in ("verify", "replay") if rep % 2 == 0 else ("replay", "verify"):
            t0 = time.perf_counter()
            scored = actors[source].score(batches[source])
            t1 = time.perf_counter()
            learner.step(scored)
            t2 = time.perf_counter()
            if rep == 0:
                summaries = [TeacherSummary.of(t) for t in scored]
                flops[source] = sum(
                    target_forward_flops(info, 1, s.scored_tokens) for s in summaries if s.target_ran
                )
                continue
            times[source]["replay"].append(t1 - t0)
            times[source]["learner"].append(t2 - t1)
            times[source]["step"].append(t2 - t0)
            print(f"[P9] {source}: replay {t1 - t0:.2f} s, learner {t2 - t1:.2f} s", flush=True)
    med = {s: {k: statistics.median(v) for k, v in t.items()} for s, t in times.items()}
    p9 = med["verify"]["step"] / med["replay"]["step"]
    replay_ratio = med["verify"]["replay"] / med["replay"]["replay"]
    flops_ratio = flops["verify"] / flops["replay"] if flops["replay"] else float("nan")
    print(
        f"P9 {p9:.3f} (step: verify {med['verify']['step']:.2f} s / replay {med['replay']['step']:.2f} s; "
        f"replay share alone {replay_ratio:.3f}; replay target FLOPs {flops_ratio:.3f})",
        flush=True,
    )
    write_result(
        args,
        "P9",
        value={
            "P9": round(p9, 3),
            "replay_only": round(replay_ratio, 3),
            "target_flops": round(flops_ratio, 3),
        },
        target="report; well under 1",
        met=p9 < 1.0,
        raw={
            "records": len(records),
            "sequences": len(items),
            "anchors": anchors,
            "median_s": med,
            "seconds": times,
            "replay_target_flops": flops,
            "draft_kind": cfg.draft.kind,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "threads": threads,
        },
    )


if __name__ == "__main__":
    main()
