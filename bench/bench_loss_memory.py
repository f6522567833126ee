"""P5: peak memory of the chunked `full` loss estimator vs naive materialisation (targets in docs/benchmarks.md), CPU, float32.

    python bench/bench_loss_memory.py                       # vocab 49152 and 151936, T = 2048, H = 576
    python bench/bench_loss_memory.py --tokens 1024 --vocabs 151936
    python bench/bench_loss_memory.py --vocabs 49152 151936 --tokens 2048 1024   # T per vocabulary

Writes results/bench/P5.json (`--out`; format: results/README.md): the ratio per vocabulary and both peaks.

Both variants compute the same thing, forward and backward: sum_t w_fwd min(FKL_t, clamp) + w_rev min(RKL_t, clamp)
with exact forward and reverse KL over the vocabulary, gradients to the hidden states (T, H) and the lm_head weight
(V, H). Naive: student logits (T, V) -> log_softmax -> both KLs from full [T x V] tensors -> autograd backward.
Chunked: `draft_opd_ray.algo.loss.full_kl` (token and vocabulary chunks, logits recomputed in backward).

How memory is measured: each variant runs in a fresh subprocess. After the inputs (hidden, lm_head weight, teacher
logits, per-token weights) are allocated and touched, the process resets its peak-RSS counter (`/proc/self/
clear_refs` = 5) and records its current RSS as the baseline; after forward + backward it reads its peak RSS
(VmHWM). Peak minus baseline is the memory beyond the inputs; the gradients (T x H, V x H) count in both variants.
glibc's mmap threshold is pinned low (MALLOC_MMAP_THRESHOLD_) so freed large blocks go back to the OS at once
and RSS follows live memory rather than allocator caching. torch's CPU allocator does not cache.

Naive materialisation peaks at about 7 x T x V x 4 bytes beyond its inputs (T x V x 4 more): 8.3 GB at T = 2048,
V = 151,936. Before each naive run the bench checks MemAvailable and stops if it would not fit with 2 GB to spare,
so that it cannot push a job beside it (a Ray actor, a vLLM engine) into the OOM killer: pass a smaller T then.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _results import add_result_args, write_result

NAIVE_BYTES_PER_LOGIT = 8 * 4  # ~7 float32 (T, V) tensors live at the naive peak, plus the teacher logits


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_variant(
    variant: str, vocab: int, tokens: int, hidden: int, token_chunk: int, vocab_chunk: int
) -> dict:
    import torch

    from draft_opd_ray.algo.loss import full_kl

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = (torch.randn(vocab, hidden) / hidden**0.5).requires_grad_()
    teacher = torch.randn(tokens, vocab) * 2
    w_fwd, w_rev = torch.rand(tokens), torch.rand(tokens)
    clamp = 10.0
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS counter to the current RSS
        f.write("5")
    base = _rss_kb("VmRSS")
    start = time.perf_counter()
    if variant == "chunked":
        num, _, _ = full_kl(h, w, teacher, w_fwd, w_rev, clamp, token_chunk, vocab_chunk)
    else:
        lq = torch.log_softmax(h @ w.T, -1)  # (T, V)
        lp = torch.log_softmax(teacher, -1)  # (T, V)
        fkl = (lp.exp() * (lp - lq)).sum(-1)
        rkl = (lq.exp() * (lq - lp)).sum(-1)
        num = (w_fwd * fkl.clamp(max=clamp)).sum() + (w_rev * rkl.clamp(max=clamp)).sum()
    num.backward()
    seconds = time.perf_counter() - start
    peak = _rss_kb("VmHWM")
    return {"peak_mb": (peak - base) / 1024, "seconds": seconds, "loss": float(num.detach())}


def check_memory(tokens: int, vocab: int) -> None:
    """Stop before a naive run that would not fit in MemAvailable with 2 GB to spare (module docstring)."""
    need_mb = NAIVE_BYTES_PER_LOGIT * tokens * vocab / 2**20 + 2048
    avail_mb = _meminfo_kb("MemAvailable") / 1024
    if avail_mb < need_mb:
        raise SystemExit(
            f"naive T={tokens} V={vocab} needs ~{need_mb:.0f} MB, {avail_mb:.0f} MB available: pass a smaller "
            "--tokens for this vocabulary"
        )


def _meminfo_kb(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/meminfo")


def measure(vocab: int, tokens: int, args: argparse.Namespace) -> dict:
    """Both variants at one vocabulary, each in a fresh child process; returns the P5 row."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    res = {}
    for variant in ("chunked", "naive"):
        if variant == "naive":
            check_memory(tokens, vocab)
        cmd = [sys.executable, __file__, "--variant", variant, "--vocabs", str(vocab), "--tokens"]
        cmd += [str(tokens), "--hidden", str(args.hidden), "--token-chunk", str(args.token_chunk)]
        cmd += ["--vocab-chunk", str(args.vocab_chunk)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        res[variant] = json.loads(out.strip().splitlines()[-1])
    c, n = res["chunked"], res["naive"]
    return {
        "vocab": vocab,
        "tokens": tokens,
        "ratio": round(c["peak_mb"] / n["peak_mb"], 3),
        "chunked_peak_mb": round(c["peak_mb"], 1),
        "naive_peak_mb": round(n["peak_mb"], 1),
        "chunked_s": round(c["seconds"], 2),
        "naive_s": round(n["seconds"], 2),
        "loss_rel_diff": abs(c["loss"] - n["loss"]) / max(abs(n["loss"]), 1e-12),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument(
        "--tokens", type=int, nargs="+", default=[2048], help="T: one value, or one per vocabulary"
    )
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--token-chunk", type=int, default=1024)
    ap.add_argument("--vocab-chunk", type=int, default=8192)
    ap.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)  # child mode
    add_result_args(ap)
    args = ap.parse_args()
    if args.variant:
        sizes = (args.tokens[0], args.hidden, args.token_chunk, args.vocab_chunk)
        print(json.dumps(run_variant(args.variant, args.vocabs[0], *sizes)))
        return
    tokens = args.tokens * len(args.vocabs) if len(args.tokens) == 1 else args.tokens
    if len(tokens) != len(args.vocabs):
        ap.error(f"--tokens: one value or one per vocabulary ({len(args.vocabs)})")
    rows = []
    for vocab, t in zip(args.vocabs, tokens):
        r = measure(vocab, t, args)
        rows.append(r)
        print(
            f"P5 vocab={vocab} chunked_peak_MB={r['chunked_peak_mb']:.0f} naive_peak_MB={r['naive_peak_mb']:.0f} "
            f"ratio={r['ratio']:.3f} (T={t} H={args.hidden} float32 CPU; chunks {args.token_chunk}x"
            f"{args.vocab_chunk}; seconds chunked={r['chunked_s']:.1f} naive={r['naive_s']:.1f}; loss rel diff "
            f"{r['loss_rel_diff']:.1e})",
            flush=True,
        )
    write_result(
        args,
        "P5",
        value={str(r["vocab"]): r["ratio"] for r in rows},
        target="<= 0.25 at each vocabulary",
        met=all(r["ratio"] <= 0.25 for r in rows),
        raw={
            "hidden": args.hidden,
            "token_chunk": args.token_chunk,
            "vocab_chunk": args.vocab_chunk,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
