"""P2 and P3 (targets in docs/benchmarks.md): anchor records against vLLM's own spec-decode counters, and the throughput cost of
recording them. vLLM CPU engines, embedded SmolLM2-135M target, standalone draft (the target's first 29 of 30
layers, which accepts roughly half of its proposals), greedy.

    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_rollout.py            # 16 MT-Bench prompts x 64 tokens, K=4
    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_rollout.py --reps 4 --orders record-first --no-global-metrics
    VLLM_CPU_KVCACHE_SPACE=1 python bench/bench_rollout.py --capture   # the workers record + keep the teacher

Writes results/bench/P2.json and results/bench/P3.json (`--out`; format: results/README.md).

P3: two engines with identical settings (target, draft, K, max_model_len, dtype, seed) are alive at once; one
runs with the anchor-recording scheduler (`record=True`), the other without (`record=False`). With `--capture` the
recording engine records in its workers instead and keeps the verification pass's teacher top-16 at every drafted
and bonus row (`rollout/verify_capture.py`; its target is >= 0.95), and handing the captured steps back
(`SpecDecodeEngine._take_capture`) is part of each timed call. After one warm-up
generation each, the timed repetitions alternate between them (A B, B A, A B, ...) so that load from other jobs on
the shared cores hits both. Each repetition is one `llm.generate` of all prompts with `ignore_eos` (equal work:
prompts x max_new_tokens tokens each time; `Sampling` has no ignore_eos, so the bench builds vLLM's
SamplingParams itself) followed by the engine's own record parsing (`SpecDecodeEngine._fill`), exactly what
`SpecDecodeEngine.generate` does. Throughput = generated tokens / wall seconds of that call.
The engine created first could run faster for reasons unrelated to recording (memory placement, which
process got which pages), so by default (`--orders both`) the bench runs two phases with fresh engines, one per
creation order, and the headline is the geometric mean over the two orders of the median per-pair ratio
(recording / plain), which cancels an order effect that multiplies. Equal work is checked: every call must
produce prompts x max_new_tokens tokens, and the vLLM verification steps of both engines are printed.
Also reported per order: mean, sd, min, max of the per-pair ratio, and the same ratio of tokens per CPU-second
(user + system time of the driver and of that engine's own processes, EngineCore and its worker): a second view
that being descheduled does not count against (cache and memory-bandwidth contention still do).

P2: tau from the anchor records (`records.tau`) / tau from vLLM's per-request counters (`records.tau_vllm`) over
every timed repetition of the recording engine (same requests, same run), plus how many requests match exactly
(steps and accepted tokens). With `--global-metrics` (default) a third engine, started after the first two are
shut down, with the recording scheduler and vLLM's stat logging on (`disable_log_stats=False`, off in
SpecDecodeEngine), runs the same prompts once and compares tau from the records with tau from vLLM's global
Prometheus counters (`llm.get_metrics()`: spec_decode_num_drafts / num_accepted_tokens).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time

from _results import add_result_args, write_result

CAPTURE_TOPK = 16  # teacher.topk's default


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _stats(xs: list[float]) -> str:
    return (
        f"median {statistics.median(xs):.4f} mean {statistics.fmean(xs):.4f} sd {_sd(xs):.4f} "
        f"min {min(xs):.4f} max {max(xs):.4f} (n={len(xs)})"
    )


def _cpu_seconds(procs) -> float:
    """user + system CPU seconds of these processes (the driver and one engine's processes)."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def timed_generate(engine, prompts: list[list[int]], max_new_tokens: int, procs=()):
    """What SpecDecodeEngine.generate does, with ignore_eos so every call produces the same number of tokens.
    Returns (records, wall seconds, generated tokens, CPU seconds of `procs`)."""
    from vllm import SamplingParams, TokensPrompt

    from draft_opd_ray.wire import RequestRecord

    params = SamplingParams(
        temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False, seed=None
    )
    cpu0 = _cpu_seconds(procs)
    start = time.perf_counter()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    captured = engine._take_capture() if engine.capture else {}
    records = [
        RequestRecord(prompt_ids=list(p), response_ids=[], request_id=str(i)) for i, p in enumerate(prompts)
    ]
    for rec, out in zip(records, outs):
        # the engine's own parsing: anchor steps (when recording) + vLLM counters
        engine._fill(rec, out, captured.get(out.request_id))
    seconds = time.perf_counter() - start
    return records, seconds, sum(len(r.response_ids) for r in records), _cpu_seconds(procs) - cpu0


def _spec_counters(llm) -> dict[str, float]:
    """vLLM's global spec-decode Prometheus counters (cumulative, summed over engines)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + float(m.value)
    return out


def global_metrics_check(target, draft, prompts, args) -> tuple[str, dict]:
    """tau from the anchor records vs vLLM's global spec-decode counters (needs stat logging on)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from draft_opd_ray.rollout.engine import SCHEDULER, speculative_config
    from draft_opd_ray.rollout.vllm_ext import TRACE_KEY
    from draft_opd_ray.rollout.worker_ext import EXTENSION

    llm = LLM(
        str(target),
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=0.5,
        speculative_config=speculative_config("standalone", str(draft), args.num_speculative_tokens),
        per_request_spec_decode_metrics="detailed",
        scheduler_cls=SCHEDULER,
        worker_extension_cls=EXTENSION,
        disable_log_stats=False,
    )
    try:
        before = _spec_counters(llm)
        params = SamplingParams(
            temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True, detokenize=False
        )
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        after = _spec_counters(llm)
        steps = accepted = req_steps = req_acc = 0
        for out in outs:
            trace = (out.kv_transfer_params or {}).get(TRACE_KEY, [])
            steps += len(trace)
            accepted += sum(int(t[2]) for t in trace)
            d = out.outputs[0].spec_decode_metrics.to_dict()
            req_steps += int(d["num_spec_steps"])
            req_acc += int(d["num_accepted_draft_tokens"])
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        g_drafts = delta.get("vllm:spec_decode_num_drafts", 0) or delta.get(
            "vllm:spec_decode_num_drafts_total", 0
        )
        g_acc = delta.get("vllm:spec_decode_num_accepted_tokens", 0) or delta.get(
            "vllm:spec_decode_num_accepted_tokens_total", 0
        )
        t_rec = 1 + accepted / steps
        t_req = 1 + req_acc / req_steps
        t_glob = 1 + g_acc / g_drafts if g_drafts else float("nan")
        line = (
            f"P2-global {t_rec / t_glob:.4f} tau_records {t_rec:.4f} tau_vllm_global {t_glob:.4f} "
            f"tau_vllm_per_request {t_req:.4f} (records: {steps} steps / {accepted} accepted; global counters: "
            f"{g_drafts:.0f} drafts / {g_acc:.0f} accepted; per-request: {req_steps} / {req_acc})"
        )
        raw = {
            "records_steps": steps,
            "records_accepted": accepted,
            "global_drafts": g_drafts,
            "global_accepted": g_acc,
            "per_request_steps": req_steps,
            "per_request_accepted": req_acc,
        }
        return line, raw
    finally:
        import contextlib

        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm


def write_p2_p3(args: argparse.Namespace, n_prompts: int, p2: dict, p3: dict) -> None:
    """results/bench/P2.json and P3.json from the run's measurements (module docstring for what each is)."""
    setup = {"prompts": n_prompts, "max_new_tokens": args.max_new_tokens, "k": args.num_speculative_tokens}
    setup |= {
        "draft_layers": args.draft_layers,
        "source": args.source,
        "reps": args.reps,
        "orders": args.orders,
        "capture_topk": CAPTURE_TOPK if args.capture else None,
    }
    value = round(p2["tau_records"] / p2["tau_vllm_per_request"], 4)
    ok = abs(value - 1) <= 0.01 and p2["inconsistent"] == 0
    write_result(args, "P2", value=value, target="1.00 +- 0.01", met=ok, raw={**setup, **p2})
    medians = [statistics.median(r) for r in p3["ratios"].values()]
    head = round(math.prod(medians) ** (1 / len(medians)), 3)
    bar = 0.95 if args.capture else 0.97
    write_result(args, "P3", value=head, target=f">= {bar}", met=head >= bar, raw={**setup, **p3})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="mtbench", help="prompt set (PromptSetConfig.source)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=29, help="standalone draft = first N target layers")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=6, help="timed pairs per creation order, interleaved")
    ap.add_argument(
        "--orders",
        choices=["both", "record-first", "plain-first"],
        default="both",
        help="which engine is created first (both: one phase each, fresh engines)",
    )
    ap.add_argument("--global-metrics", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--capture",
        action="store_true",
        help="record by verify-pass capture (top-16 teacher) instead of the scheduler",
    )
    add_result_args(ap)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    import psutil
    from transformers import AutoTokenizer

    from draft_opd_ray.config.schema import DraftConfig, PromptSetConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.data.prompts import load_prompt_set
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.rollout.engine import EngineRun, SpecDecodeEngine
    from draft_opd_ray.rollout.records import tau, tau_vllm
    from draft_opd_ray.wire import consistency_error

    t_all = time.perf_counter()
    target = ensure_embedded_target()
    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    try:
        draft = build_standalone_from_target(target, tmp, layer_ids=list(range(args.draft_layers)))
        tok = AutoTokenizer.from_pretrained(target)
        pset = load_prompt_set(PromptSetConfig(source=args.source, max_prompts=args.prompts), tok)
        prompts = [list(p.token_ids) for p in pset.prompts]
        print(
            f"setup: {len(prompts)} {pset.name} prompts (mean {statistics.fmean(map(len, prompts)):.0f} tokens), "
            f"{args.max_new_tokens} new tokens each, K={args.num_speculative_tokens}, standalone draft of {args.draft_layers} layers",
            flush=True,
        )
        configs = (
            DraftConfig(kind="standalone", num_speculative_tokens=args.num_speculative_tokens),
            TargetConfig(max_model_len=args.max_model_len),
            RolloutConfig(),
        )
        expect = len(prompts) * args.max_new_tokens
        starts = {"both": ("record", "plain"), "record-first": ("record",), "plain-first": ("plain",)}
        thr: dict[str, list[float]] = {"record": [], "plain": []}
        cpu: dict[str, list[float]] = {"record": [], "plain": []}
        ratios: dict[str, list[float]] = {}  # creation order -> per-pair wall-throughput ratios
        cpu_ratios: dict[str, list[float]] = {}
        all_recs = []
        steps_per_call: dict[str, set[int]] = {"record": set(), "plain": set()}
        for first in starts[args.orders]:
            names = (first, "plain" if first == "record" else "record")
            phase = f"{first}-first"
            ratios[phase], cpu_ratios[phase] = [], []
            me = psutil.Process()
            procs: dict[str, list] = {}
            engines: dict = {}
            try:
                for name in names:  # both alive at once; each engine's own processes tracked for CPU time
                    before = {p.pid for p in me.children(recursive=True)}
                    t0 = time.perf_counter()
                    capture = CAPTURE_TOPK if args.capture and name == "record" else None
                    run = EngineRun(
                        target, "standalone", draft, record=name == "record", capture_topk=capture
                    )
                    engines[name] = SpecDecodeEngine(run, *configs)
                    procs[name] = [me] + [p for p in me.children(recursive=True) if p.pid not in before]
                    print(f"[{phase}] engine start {name}: {time.perf_counter() - t0:.1f} s", flush=True)
                for name, eng in engines.items():  # warm-up
                    _, s, n, _ = timed_generate(eng, prompts, args.max_new_tokens)
                    print(f"[{phase}] warm-up {name}: {n} tokens in {s:.2f} s", flush=True)
                for rep in range(args.reps):
                    order = ("record", "plain") if rep % 2 == 0 else ("plain", "record")
                    got, got_cpu = {}, {}
                    for name in order:
                        recs, s, n, c = timed_generate(
                            engines[name], prompts, args.max_new_tokens, procs[name]
                        )
                        if n != expect:
                            raise RuntimeError(f"{name}: {n} tokens, expected {expect}")
                        got[name], got_cpu[name] = n / s, n / c
                        thr[name].append(n / s)
                        cpu[name].append(n / c)
                        steps_per_call[name].add(sum(r.vllm_steps for r in recs))
                        if name == "record":
                            all_recs += recs
                    ratios[phase].append(got["record"] / got["plain"])
                    cpu_ratios[phase].append(got_cpu["record"] / got_cpu["plain"])
                    print(
                        f"[{phase}] rep {rep} ({'/'.join(order)}): record {got['record']:.1f} tok/s "
                        f"({got_cpu['record']:.1f} tok/CPU-s), plain {got['plain']:.1f} tok/s ({got_cpu['plain']:.1f} "
                        f"tok/CPU-s), ratio {ratios[phase][-1]:.4f} (CPU {cpu_ratios[phase][-1]:.4f})",
                        flush=True,
                    )
            finally:
                for eng in engines.values():
                    eng.shutdown()

        bad = sum(consistency_error(r) is not None for r in all_recs)
        exact = sum(r.num_steps == r.vllm_steps and sum(r.accepted) == r.vllm_accepted for r in all_recs)
        t, tv = tau(all_recs), tau_vllm(all_recs)
        steps = sum(r.num_steps for r in all_recs)
        print(
            f"P2 {t / tv:.4f} tau_records {t:.4f} tau_vllm_per_request {tv:.4f} over {len(all_recs)} requests "
            f"({steps} verification steps); exact per-request match {exact}/{len(all_recs)}; "
            f"inconsistent records {bad} (target 1.00 +- 0.01)"
        )
        for phase in ratios:
            print(
                f"P3 [{phase}] per-pair wall ratio {_stats(ratios[phase])}; "
                f"tokens per CPU-second ratio {_stats(cpu_ratios[phase])}"
            )
        # geometric mean over creation orders of the per-order median: cancels an engine-order effect
        head = math.prod(statistics.median(r) for r in ratios.values()) ** (1 / len(ratios))
        head_cpu = math.prod(statistics.median(r) for r in cpu_ratios.values()) ** (1 / len(cpu_ratios))
        pooled = [x for r in ratios.values() for x in r]
        m_rec, m_plain = statistics.fmean(thr["record"]), statistics.fmean(thr["plain"])
        print(
            f"P3 {head:.4f} wall-throughput ratio record/plain (geometric mean over creation orders "
            f"{', '.join(ratios)} of the median per-pair ratio; pooled {_stats(pooled)}); tokens per CPU-second "
            f"{head_cpu:.4f}; record {m_rec:.1f} tok/s (sd {_sd(thr['record']):.1f}), plain {m_plain:.1f} tok/s "
            f"(sd {_sd(thr['plain']):.1f}); {len(prompts)} prompts x {args.max_new_tokens} tokens, K={args.num_speculative_tokens}, "
            f"tau {t:.2f}; vLLM steps per call record {sorted(steps_per_call['record'])} plain "
            f"{sorted(steps_per_call['plain'])} (target >= {0.95 if args.capture else 0.97})"
        )
        glob = None
        if args.global_metrics:
            line, glob = global_metrics_check(target, draft, prompts, args)
            print(line, flush=True)
        p2 = {"requests": len(all_recs), "steps": steps, "exact": exact, "inconsistent": bad, "global": glob}
        p2 |= {"tau_records": t, "tau_vllm_per_request": tv}
        p3 = {"ratios": ratios, "cpu_ratios": cpu_ratios, "tokens_per_s": thr, "tokens_per_cpu_s": cpu}
        p3 |= {"head_cpu": head_cpu, "steps_per_call": {k: sorted(v) for k, v in steps_per_call.items()}}
        write_p2_p3(args, len(prompts), p2, p3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
