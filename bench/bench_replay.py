"""P4: teacher scoring of all anchors of a sequence vs one plain target forward over the same number of tokens.

    python bench/bench_replay.py                      # SmolLM2 target, 6 sequences, 32 anchors each, K = 4
    python bench/bench_replay.py --anchors 64 --repeats 5
    python bench/bench_replay.py --prompts 768 --traj-dtype bfloat16   # the default SFT run's cached answers

Writes results/bench/P4.json (`--out`; format: results/README.md): P4, naive beside it, every sequence's timings.

Sequences are the target's own greedy answers to the first `--prompts` ShareGPT train prompts (the SFT trajectory
cache keyed by prompts and `--traj-dtype`, generated with vLLM if missing), the first `--sequences` whose answer
has at least `--min-response` tokens. On each, anchors are spread over the response with accepted counts a ~ U{0..K} and a
block whose first a tokens are the committed continuation and whose rest are random ids (what matters for the
cost is the number of anchors and of branch tokens, not which ids they carry).

Three ways to get the teacher distributions p_k for k = 1..K of every anchor, timed interleaved:
    packed   `ReplayActor._score_one`: one forward over the sequence plus every anchor's rejected branch
             (tree mask), features and draft-vocabulary log-probs included -- what the OPD loop runs;
    plain    the target forward over the same number of tokens (T + branch tokens), logits only: the P4
             denominator;
    naive    one full forward over x_{<=n} + y_{<K} per anchor (re-scoring every prefix).
P4 = median over sequences of median(packed) / median(plain); target <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
from _results import add_result_args, write_result


def time_sequence(t, actor, model, rng: random.Random, args: argparse.Namespace) -> dict:
    """Median seconds of packed, plain (and naive) scoring of one trajectory, interleaved over repeats."""
    from draft_opd_ray.wire import ReplayItem, pack_branches

    num_speculative_tokens = args.num_speculative_tokens
    seq = t.prompt_ids + t.response_ids
    p, T = len(t.prompt_ids), len(seq)
    positions = sorted(
        rng.sample(
            range(p - 1, T - num_speculative_tokens - 1), min(args.anchors, T - num_speculative_tokens - p)
        )
    )
    drafted, accepted = [], []
    for n in positions:
        a = rng.randint(0, num_speculative_tokens)
        drafted.append(
            seq[n + 1 : n + 1 + a] + [rng.randrange(100, 40000) for _ in range(num_speculative_tokens - a)]
        )
        accepted.append(a)
    item = ReplayItem(seq, positions, drafted, accepted, policy_version=0)
    L = len(pack_branches(item, num_speculative_tokens).input_ids)
    plain_ids = torch.tensor([seq + seq[: L - T]])

    def packed() -> None:
        actor.score([item])

    def plain() -> None:
        model(plain_ids, use_cache=False)

    def naive() -> None:
        for n, y in zip(item.anchor_pos, item.drafted):
            model(torch.tensor([item.input_ids[: n + 1] + y[: num_speculative_tokens - 1]]), use_cache=False)

    fns: dict[str, Callable[[], None]] = {
        "packed": packed,
        "plain": plain,
        **({"naive": naive} if args.naive else {}),
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        packed()  # warm-up
        for r in range(args.repeats):
            for name in list(fns) if r % 2 == 0 else list(reversed(fns)):
                tic = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - tic)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "T": T,
        "anchors": len(positions),
        "scored_tokens": L,
        "branch_tokens": L - T,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "packed_over_plain": round(med["packed"] / med["plain"], 3),
        "repeats_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    if args.naive:
        row["naive_over_plain"] = round(med["naive"] / med["plain"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=6)
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence (anchor.max_per_sequence)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-response", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=64, help="ShareGPT train prompts of the trajectory cache")
    ap.add_argument("--traj-dtype", default="float32", help="the trajectory cache's serving precision")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--naive", action="store_true", default=True)
    ap.add_argument("--no-naive", dest="naive", action="store_false")
    add_result_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from draft_opd_ray.cache import default_cache_dir
    from draft_opd_ray.config.schema import DraftConfig, LossConfig, ReplayConfig, TeacherConfig
    from draft_opd_ray.data.prompts import prompt_ids
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.models.target import target_stop_token_ids
    from draft_opd_ray.opd.replay import ReplayActor, ReplayRun
    from draft_opd_ray.sft.data import generate_trajectories, read_trajectories

    target = ensure_embedded_target()
    trajs = read_trajectories(
        generate_trajectories(
            target,
            prompt_ids("sharegpt", "train", args.prompts, target),
            default_cache_dir(),
            stop_token_ids=target_stop_token_ids(target),
            dtype=args.traj_dtype,
        )
    )
    trajs = [t for t in trajs if len(t.response_ids) >= args.min_response][: args.sequences]
    configs = (
        DraftConfig(num_speculative_tokens=args.num_speculative_tokens),
        TeacherConfig(dtype="float32", topk=None),  # the full payload
        LossConfig(),
        ReplayConfig(),
    )
    actor = ReplayActor(ReplayRun(str(target), [2, 15, 27], None), *configs)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    rng = random.Random(0)
    rows = []
    for t in trajs:
        rows.append(time_sequence(t, actor, model, rng, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "repeats_s"}), flush=True)
    p4 = round(statistics.median(r["packed_over_plain"] for r in rows), 3)
    summary = {
        "P4": p4,
        "sequences": len(rows),
        "anchors_per_sequence": args.anchors,
        "K": args.num_speculative_tokens,
    }
    if args.naive:
        summary["naive_over_plain"] = round(statistics.median(r["naive_over_plain"] for r in rows), 2)
    print(json.dumps(summary), flush=True)
    write_result(
        args,
        "P4",
        value=p4,
        target="<= 1.25",
        met=p4 <= 1.25,
        raw={**summary, "threads": args.threads, "dtype": "float32", "per_sequence": rows},
    )


if __name__ == "__main__":
    main()
