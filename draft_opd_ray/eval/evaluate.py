"""Evaluation: τ of a draft on held-out prompts (from our anchor records and from vLLM's own counters),
per-position acceptance, and served speed-up over plain target decoding at each concurrency, with vLLM's
`ngram` method measured beside it on the same prompts. Writes `eval/report.{json,md}` and plots.

Every method's τ comes with its number of requests `n`, a 95% bootstrap CI over prompts (`tau_ci`) and the
per-request counts (`per_prompt`, in prompt order) it was computed from. The draft's `paired` entry holds
paired differences on the same prompts (`eval/stats.py`): after − before, and draft − each baseline.

One vLLM engine at a time (a small CPU box runs one well): draft, each baseline, then the plain target.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_opd_ray.checkpoint import write_text_atomic
from draft_opd_ray.config.schema import ClusterConfig, DraftConfig, EvalConfig, RolloutConfig, TargetConfig
from draft_opd_ray.errors import DataError
from draft_opd_ray.eval.stats import paired_diff
from draft_opd_ray.eval.tau import measure_all, tau_entry
from draft_opd_ray.metrics import finite
from draft_opd_ray.rollout.engine import (
    BASELINES,
    EngineRun,
    Sampling,
    SpecDecodeEngine,
    all_cores,
    async_by_default,
    speculative_config,
)
from draft_opd_ray.rollout.records import acceptance_per_position


def _tokens_per_second(
    engine: SpecDecodeEngine, prompts: Sequence[list[int]], sampling: Sampling, c: int
) -> float:
    """Generated tokens per second when requests are served `c` at a time."""
    engine.generate(prompts[:1], Sampling(max_new_tokens=8))  # warm-up
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), c):
        tokens += sum(len(r.response_ids) for r in engine.generate(prompts[i : i + c], sampling))
    return tokens / (time.perf_counter() - t0)


def _measure(
    engine: SpecDecodeEngine,
    prompts: Sequence[list[int]],
    sampling: Sampling,
    num_speculative_tokens: int,
    concurrency: Sequence[int],
    speed_prompts: int,
    measured: tuple[dict[str, float], list[Any]],
) -> dict[str, Any]:
    """τ entry, per-position acceptance and tokens/s at each concurrency of one method on one eval set (the
    first max(speed_prompts, c) prompts at concurrency c, so that c requests are in flight at once).
    ``measured``: `measure_all` of ``prompts`` (by the recording engine); ``engine`` runs the speed runs."""
    stats, recs = measured
    ok = [r for r in recs if not r.error]
    drafted = any(r.num_steps for r in ok)
    out: dict[str, Any] = {
        **tau_entry(stats, recs),
        "acceptance_per_position": acceptance_per_position(ok, num_speculative_tokens) if drafted else [],
        "tokens_per_s": {
            c: _tokens_per_second(engine, prompts[: max(speed_prompts, c)], sampling, c) for c in concurrency
        },
    }
    return out


@dataclass(frozen=True)
class EvalRun:
    """What only the run knows about an evaluation; the rest comes from `eval.*`, `draft.*`, `target.*`,
    `rollout.*` and `cluster.*`. ``target``: the target's local folder. ``stop_token_ids``: the ids that end its
    answers (`models.target.stop_token_ids`). ``before``: the draft the run started from (same kind and
    vocabulary); its τ is measured in the same engine first (records and vLLM's counters, no speed runs) and
    reported beside the final draft's. ``speed_prompts``: prompts of each speed run (at least the concurrency)."""

    target: str | Path
    draft_path: str | Path | None
    datasets: dict[str, list[list[int]]]
    out_dir: str | Path
    stop_token_ids: Sequence[int]
    before: str | Path | None = None
    speed_prompts: int = 8


def evaluate(
    run: EvalRun,
    cfg: EvalConfig,
    draft: DraftConfig,
    target: TargetConfig,
    rollout: RolloutConfig,
    cluster: ClusterConfig,
) -> dict[str, Any]:
    """Measure the draft, each of `eval.baselines` and the plain target on every eval set, one engine at a time;
    write the report. Raises `DataError` before any engine starts when an eval set has no prompts. Each engine
    serves the target as the rollout engines do (`target.dtype`, `rollout.gpu_memory_utilization`,
    `cluster.rollout_tensor_parallel`)."""
    check_datasets(run.datasets)
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sampling = Sampling(max_new_tokens=cfg.max_new_tokens, stop_token_ids=tuple(run.stop_token_ids))
    draft_path = str(run.draft_path) if run.draft_path else None
    methods = [(draft.kind, draft_path)] + [(b, None) for b in cfg.baselines] + [(BASELINES[0], None)]
    results: dict[str, dict[str, Any]] = {name: {} for name in run.datasets}
    tau_before: dict[str, dict[str, Any]] = {}
    for kind, path in methods:

        def start(weights: str | None, record: bool, kind: str = kind) -> SpecDecodeEngine:
            engine_run = EngineRun(
                run.target,
                kind,
                weights,
                record=record,
                cpu_bind=all_cores(),  # alone on the machine: on CPU, every core (vLLM's auto takes one)
                tensor_parallel=cluster.rollout_tensor_parallel,
            )
            return SpecDecodeEngine(engine_run, draft, target, rollout)

        first = str(run.before) if run.before is not None and kind == draft.kind else path
        per_set = _measure_method(
            start, first, path, run, cfg, draft.num_speculative_tokens, sampling, tau_before
        )
        for name, res in per_set.items():
            results[name][kind] = res
    report = build_report(
        target=run.target,
        draft_kind=draft.kind,
        draft_path=run.draft_path,
        before=run.before,
        num_speculative_tokens=draft.num_speculative_tokens,
        results=results,
        tau_before=tau_before,
        concurrency=cfg.concurrency,
    )
    write_text_atomic(out / "report.json", json.dumps(finite(report), indent=2, allow_nan=False) + "\n")
    write_text_atomic(out / "report.md", render_markdown(report))
    plot_acceptance(report, out)
    plot_speedup(report, out)
    return report


def _measure_method(
    start: Callable[[str | None, bool], SpecDecodeEngine],
    first: str | None,
    path: str | None,
    run: EvalRun,
    cfg: EvalConfig,
    num_speculative_tokens: int,
    sampling: Sampling,
    tau_before: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """One method on every eval set: `_measure`'s entry by set name. ``start(weights, record)`` builds its engine;
    ``first`` != ``path``: the before-draft's τ is measured first (into ``tau_before``), then the final weights
    are loaded into the same engine."""
    engine = start(first, True)
    try:
        if first != path:
            from safetensors.torch import load_file

            for name, prompts in run.datasets.items():
                tau_before[name] = tau_entry(*measure_all(engine, prompts, sampling))
                print(f"[eval] {name}: before τ {tau_before[name]['tau']:.3f}", flush=True)
            assert path is not None
            engine.load_draft_weights(load_file(str(Path(path) / "model.safetensors")), 1)
        measured = {name: measure_all(engine, prompts, sampling) for name, prompts in run.datasets.items()}
        if engine.record and async_by_default():
            # speed as served: recording needs synchronous scheduling, vLLM's default on GPUs is async
            engine.shutdown()
            engine = start(path, False)
        return {
            name: _measure(
                engine,
                prompts,
                sampling,
                num_speculative_tokens,
                cfg.concurrency,
                run.speed_prompts,
                measured[name],
            )
            for name, prompts in run.datasets.items()
        }
    finally:
        engine.shutdown()


def check_datasets(datasets: dict[str, list[list[int]]]) -> None:
    """Every eval set has prompts (`DataError` naming the first that has none)."""
    if not datasets:
        raise DataError("eval: no eval sets given")
    for name, prompts in datasets.items():
        if not prompts:
            raise DataError(f"eval set {name!r} has no prompts")


def build_report(
    *,
    target: str | Path,
    draft_kind: str,
    draft_path: str | Path | None,
    before: str | Path | None,
    num_speculative_tokens: int,
    results: dict[str, dict[str, dict[str, Any]]],
    tau_before: dict[str, dict[str, Any]],
    concurrency: Sequence[int],
) -> dict[str, Any]:
    """The report from each eval set's per-method measurements (``results[dataset][method]``, the plain target
    under `BASELINES[0]`) and the before-draft's τ entries."""
    report: dict[str, Any] = {
        "target": str(target),
        "draft": str(draft_path),
        "draft_before": str(before) if before is not None else None,
        "speculative_config": speculative_config(
            draft_kind, str(draft_path) if draft_path else None, num_speculative_tokens
        ),
        "datasets": {},
        "baselines": {},
    }
    for name, per in results.items():
        plain = per[BASELINES[0]]["tokens_per_s"]
        for kind, res in per.items():
            if kind == BASELINES[0]:
                continue
            entry = {
                **{key: res[key] for key in ("tau", "tau_vllm", "n", "tau_ci", "acceptance_per_position")},
                "speedup": {str(c): res["tokens_per_s"][c] / plain[c] for c in concurrency},
                "tokens_per_s": {str(c): v for c, v in res["tokens_per_s"].items()},
                "per_prompt": res["per_prompt"],
            }
            if kind == draft_kind:
                if name in tau_before:
                    entry["before"] = tau_before[name]
                report["datasets"][name] = entry
            else:
                report["baselines"].setdefault(kind, {})[name] = entry
        report.setdefault("plain_tokens_per_s", {})[name] = {str(c): v for c, v in plain.items()}
    for name, entry in report["datasets"].items():
        entry["paired"] = paired_entries(
            entry, {b: per[name] for b, per in report["baselines"].items() if name in per}
        )
    return report


def paired_entries(
    entry: dict[str, Any], baselines: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Paired differences of the draft on one eval set: ``before`` (after − before, when measured) and each
    baseline (draft − baseline), all on the same prompts."""
    others = {"before": entry["before"]} if "before" in entry else {}
    others |= baselines
    return {name: paired_diff(entry["per_prompt"], e["per_prompt"]) for name, e in others.items()}


def _fmt_tau(e: dict[str, Any]) -> str:
    t = f"{e['tau']:.3f}" if e.get("tau") is not None else "-"
    if "tau_ci" in e:
        lo, hi = e["tau_ci"]
        t += f" [{lo:.3f}, {hi:.3f}]"
    return t


def ci_words(lo: float, hi: float) -> str:
    """Whether a CI of a difference excludes zero, in words."""
    if lo > 0:
        return "CI above zero"
    if hi < 0:
        return "CI below zero"
    return "CI includes zero"


def paired_line(name: str, label: str, d: dict[str, float]) -> str:
    """One markdown bullet for a paired difference, e.g. ``after − before: +0.031 [+0.012, +0.050] (CI above
    zero)``, followed by the pooled-τ difference and the share of prompts where the first side is better."""
    if not d.get("n"):
        return f"- {name}: {label}: no prompt with verification steps on both sides"
    return (
        f"- {name}: {label}: {d['mean']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] ({ci_words(d['lo'], d['hi'])}); "
        f"pooled τ {d['pooled']:+.3f} [{d['pooled_lo']:+.3f}, {d['pooled_hi']:+.3f}] "
        f"({ci_words(d['pooled_lo'], d['pooled_hi'])}); better on {100 * d['share_better']:.0f}% of "
        f"{d['n']} prompts"
    )


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Evaluation report",
        "",
        f"- target: `{report['target']}`",
        f"- draft: `{report['draft']}`",
        f"- speculative_config: `{json.dumps(report['speculative_config'])}`",
        "",
        "| dataset | method | n | τ (records) [95% CI] | τ (vLLM) | speed-up by concurrency |",
        "|---|---|---|---|---|---|",
    ]

    def row(name: str, method: str, e: dict[str, Any]) -> str:
        sp = ", ".join(f"c={c}: {v:.2f}x" for c, v in e.get("speedup", {}).items()) or "-"
        return f"| {name} | {method} | {e.get('n', '-')} | {_fmt_tau(e)} | {e['tau_vllm']:.3f} | {sp} |"

    for name, e in report["datasets"].items():
        if "before" in e:
            lines.append(row(name, "draft before (start of run)", e["before"]))
        lines.append(row(name, "draft", e))
        for b, per in report["baselines"].items():
            if name in per:
                lines.append(row(name, b, per[name]))
    paired = [
        paired_line(name, "after − before" if other == "before" else f"draft − {other}", d)
        for name, e in report["datasets"].items()
        for other, d in e.get("paired", {}).items()
    ]
    if paired:
        lines += ["", "Paired differences of per-prompt τ on the same prompts (mean [95% bootstrap CI]):", ""]
        lines += paired
    return "\n".join(lines) + "\n"


def plot_speedup(report: dict[str, Any], out: Path) -> None:
    """`speedup_<dataset>.png`: speed-up over plain decoding vs concurrency, the draft beside each baseline;
    only for eval sets with more than one concurrency or a baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, e in report["datasets"].items():
        methods = {"draft": e} | {b: per[name] for b, per in report["baselines"].items() if name in per}
        if len(e["speedup"]) < 2 and len(methods) < 2:
            continue
        fig, ax = plt.subplots(figsize=(5, 3))
        for label, m in methods.items():
            cs = sorted(m["speedup"], key=int)
            ax.plot([int(c) for c in cs], [m["speedup"][c] for c in cs], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speed-up over plain decoding")
        ax.set_title(f"{name} (held-out prompts): speed-up")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"speedup_{name}.png", dpi=100)
        plt.close(fig)


def plot_acceptance(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, e in report["datasets"].items():
        acc = e["acceptance_per_position"]
        if not acc:
            continue
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(range(1, len(acc) + 1), acc)
        ax.set_xlabel("position in drafted block")
        ax.set_ylabel("P(accepted)")
        ax.set_ylim(0, 1)
        ax.set_title(f"{name} (held-out prompts): τ {e['tau']:.2f} (vLLM {e['tau_vllm']:.2f})")
        fig.tight_layout()
        fig.savefig(out / f"acceptance_{name}.png", dpi=100)
        plt.close(fig)
