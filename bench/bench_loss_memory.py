"""P5: peak memory of the chunked `full` loss estimator vs naive materialisation (targets in docs/benchmarks.md), CPU, float32.

    python bench/bench_loss_memory.py                       # vocab 49152 and 151936, T = 2048, H = 576
    python bench/bench_loss_memory.py --tokens 1024 --vocabs 151936

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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--token-chunk", type=int, default=1024)
    ap.add_argument("--vocab-chunk", type=int, default=8192)
    ap.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    sizes = (args.tokens, args.hidden, args.token_chunk, args.vocab_chunk)
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.vocabs[0], *sizes)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for vocab in args.vocabs:
        res = {}
        for variant in ("chunked", "naive"):
            cmd = [sys.executable, __file__, "--variant", variant, "--vocabs", str(vocab), "--tokens"]
            cmd += [str(args.tokens), "--hidden", str(args.hidden), "--token-chunk", str(args.token_chunk)]
            cmd += ["--vocab-chunk", str(args.vocab_chunk)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            res[variant] = json.loads(out.strip().splitlines()[-1])
        c, n = res["chunked"], res["naive"]
        rel = abs(c["loss"] - n["loss"]) / max(abs(n["loss"]), 1e-12)
        print(
            f"P5 vocab={vocab} chunked_peak_MB={c['peak_mb']:.0f} naive_peak_MB={n['peak_mb']:.0f} "
            f"ratio={c['peak_mb'] / n['peak_mb']:.3f} (T={args.tokens} H={args.hidden} float32 CPU; "
            f"chunks {args.token_chunk}x{args.vocab_chunk}; seconds chunked={c['seconds']:.1f} "
            f"naive={n['seconds']:.1f}; loss rel diff {rel:.1e})",
            flush=True,
        )


if __name__ == "__main__":
    main()
