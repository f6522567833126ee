"""T-threads, in process: a standalone draft's replay and learner step at one torch thread vs this node's cores.

    python bench/bench_threads.py                    # 4 sequences, a 6-layer slice of the SmolLM2 target
    python bench/bench_threads.py --sequences 8 --layers 2

Writes results/bench/T-threads.json (`--out`; format: results/README.md): the in-process ratios only; the whole
loop's step times of the T-threads line come from `python -m draft_opd_ray.main` runs, not from this script.

What `cluster.cpu_threads=auto` changes on a CPU cluster (`loop/actors.py: cpu_share`): the learner runs on every
core of its node, the replay on those no vLLM engine is bound to. This times the two pieces alone, on the same
synthetic sequences (600 tokens, an anchor every 1-5 tokens after a 150-token prompt, blocks partly accepted: what
matters for the cost is the number of anchors and branch tokens, not which ids they carry), and checks that the
teacher and the updated weights are the same at both thread counts. The whole loop's step time, engines included,
is the benchmark line's other command (docs/benchmarks.md, T-threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path

import torch
from _results import add_result_args, write_result


def items(n: int, num_speculative_tokens: int, length: int = 600, prompt: int = 150) -> list:
    from draft_opd_ray.wire import ReplayItem

    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids = [rng.randrange(100, 40000) for _ in range(length)]
        anchors, drafted, accepted = [], [], []
        pos = prompt
        while pos < length - 1:
            kv = min(num_speculative_tokens, length - 1 - pos)
            a = min(rng.choice([0, 0, 0, 1, 1, 2, 4]), kv)
            anchors.append(pos)
            drafted.append(ids[pos + 1 : pos + 1 + a] + [rng.randrange(100, 40000) for _ in range(kv - a)])
            accepted.append(a)
            pos += a + 1
        out.append(ReplayItem(ids, anchors, drafted, accepted, 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument(
        "--layers", type=int, default=6, help="the slice: the first ceil(n/2) and last floor(n/2)"
    )
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    add_result_args(ap)
    args = ap.parse_args()

    from draft_opd_ray.cache import default_cache_dir
    from draft_opd_ray.config.schema import Config, DraftConfig, LearnerConfig, ReplayConfig, TeacherConfig
    from draft_opd_ray.device import node_threads
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.models.target import read_target_info
    from draft_opd_ray.opd.learner import Learner, LearnerRun
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun

    target = ensure_embedded_target()
    n_target = read_target_info(target).num_layers
    half = (args.layers + 1) // 2
    layer_ids = list(range(half)) + list(range(n_target - (args.layers - half), n_target))
    draft = Path(default_cache_dir()) / "bench" / f"standalone_slice_{'_'.join(map(str, layer_ids))}"
    if not (draft / "config.json").exists():
        build_standalone_from_target(target, draft, layer_ids=layer_ids)
    batch = items(args.sequences, args.num_speculative_tokens)
    cfg = Config()
    draft_cfg = DraftConfig(kind="standalone", num_speculative_tokens=args.num_speculative_tokens)
    optim = dataclasses.replace(cfg.optim, warmup_ratio=0.0, schedule="constant")
    learner_cfg = LearnerConfig(zero_stage=cfg.learner.zero_stage, dtype="float32")
    replay_cfgs = (
        TeacherConfig(dtype="float32", topk=16),
        dataclasses.replace(cfg.loss, draft_topm=0),
        ReplayConfig(),
    )
    cores = node_threads()
    times: dict[int, tuple[float, float]] = {}
    teacher, weights = {}, {}
    for threads in (1, cores):
        torch.set_num_threads(threads)
        replay = ReplayActor(ReplayRun(str(target), [], None), draft_cfg, *replay_cfgs)
        t0 = time.perf_counter()
        teacher[threads] = replay.score(batch)
        t1 = time.perf_counter()
        run = LearnerRun(str(draft), str(target), total_steps=len(batch))
        learner = Learner(run, draft_cfg, cfg.loss, optim, learner_cfg)
        t2 = time.perf_counter()
        learner.step(teacher[1], mini_batches=len(batch))
        times[threads] = (t1 - t0, time.perf_counter() - t2)
        weights[threads] = learner.rollout_state()
    anchors = sum(len(it.anchor_pos) for it in batch)
    same_teacher = all(
        torch.equal(a.teacher_topk_logprobs, b.teacher_topk_logprobs)  # type: ignore[arg-type]
        for a, b in zip(teacher[1], teacher[cores])
    )
    same_weights = all(torch.equal(weights[1][k], weights[cores][k]) for k in weights[1])
    (r1, l1), (rn, ln) = times[1], times[cores]
    print(
        f"T-threads (in process) replay {rn / r1:.2f} ({rn:.1f} s on {cores} threads vs {r1:.1f} s on 1), "
        f"learner {ln / l1:.2f} ({ln:.1f} vs {l1:.1f} s); {len(batch)} sequences, {anchors} anchors, "
        f"{args.layers}-layer standalone slice, float32; teacher identical: {same_teacher}, "
        f"weights identical: {same_weights}"
    )
    write_result(
        args,
        "T-threads",
        value={"replay": round(rn / r1, 2), "learner": round(ln / l1, 2)},
        target=None,  # reported, no bar
        met=None,
        raw={
            "threads": cores,
            "replay_s": {"1": r1, str(cores): rn},
            "learner_s": {"1": l1, str(cores): ln},
            "sequences": len(batch),
            "anchors": anchors,
            "layers": args.layers,
            "teacher_identical": same_teacher,
            "weights_identical": same_weights,
        },
    )


if __name__ == "__main__":
    main()
