"""Evaluation: τ of a draft on held-out prompts (from our anchor records and from vLLM's own counters),
per-position acceptance, and served speed-up over plain target decoding at each concurrency, with vLLM's
`ngram` method measured beside it on the same prompts. Writes `eval/report.{json,md}` and plots.

One vLLM engine at a time (this machine has 2 cores): draft, each baseline, then the plain target.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.eval.tau import measure
from draft_opd_ray.rollout.engine import BASELINES, Sampling, SpecDecodeEngine, speculative_config
from draft_opd_ray.rollout.records import RequestRecord, acceptance_per_position


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
    k: int,
    concurrency: Sequence[int],
    speed_prompts: int,
) -> tuple[dict[str, Any], list[RequestRecord]]:
    stats, recs = measure(engine, prompts, sampling)
    out: dict[str, Any] = {
        "tau": stats["tau"],
        "tau_vllm": stats["tau_vllm"],
        "acceptance_per_position": acceptance_per_position(recs, k) if any(r.num_steps for r in recs) else [],
        "tokens_per_s": {
            c: _tokens_per_second(engine, prompts[:speed_prompts], sampling, c) for c in concurrency
        },
    }
    return out, recs


def evaluate(
    *,
    target: str | Path,
    draft_kind: str,
    draft_path: str | Path | None,
    k: int,
    datasets: dict[str, list[list[int]]],
    out_dir: str | Path,
    max_new_tokens: int,
    eos_token_id: int | None,
    concurrency: Sequence[int] = (1,),
    baselines: Sequence[str] = ("ngram",),
    max_model_len: int = 2048,
    speed_prompts: int = 8,
    before: str | Path | None = None,
) -> dict[str, Any]:
    """``before``: the draft the run started from (same kind and vocabulary); its τ is measured in the same
    engine first (records and vLLM's counters, no speed runs) and reported beside the final draft's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sampling = Sampling(
        max_new_tokens=max_new_tokens, stop_token_ids=(eos_token_id,) if eos_token_id is not None else ()
    )
    methods = (
        [(draft_kind, str(draft_path) if draft_path else None)]
        + [(b, None) for b in baselines]
        + [(BASELINES[0], None)]
    )
    results: dict[str, dict[str, Any]] = {name: {} for name in datasets}
    tau_before: dict[str, dict[str, float]] = {}
    for kind, path in methods:
        first = str(before) if before is not None and kind == draft_kind else path
        engine = SpecDecodeEngine(
            target, draft_kind=kind, draft_path=first, num_speculative_tokens=k, max_model_len=max_model_len
        )
        try:
            if first != path:
                from safetensors.torch import load_file

                for name, prompts in datasets.items():
                    stats, _ = measure(engine, prompts, sampling)
                    tau_before[name] = {"tau": stats["tau"], "tau_vllm": stats["tau_vllm"]}
                    print(f"[eval] {name}: before τ {tau_before[name]['tau']:.3f}", flush=True)
                assert path is not None
                engine.load_draft_weights(load_file(str(Path(path) / "model.safetensors")), 1)
            for name, prompts in datasets.items():
                res, _ = _measure(engine, prompts, sampling, k, concurrency, speed_prompts)
                results[name][kind] = res
        finally:
            engine.shutdown()
    report: dict[str, Any] = {
        "target": str(target),
        "draft": str(draft_path),
        "draft_before": str(before) if before is not None else None,
        "speculative_config": speculative_config(draft_kind, str(draft_path) if draft_path else None, k),
        "datasets": {},
        "baselines": {},
    }
    for name, per in results.items():
        plain = per[BASELINES[0]]["tokens_per_s"]
        for kind, res in per.items():
            if kind == BASELINES[0]:
                continue
            entry = {
                "tau": res["tau"],
                "tau_vllm": res["tau_vllm"],
                "acceptance_per_position": res["acceptance_per_position"],
                "speedup": {str(c): res["tokens_per_s"][c] / plain[c] for c in concurrency},
                "tokens_per_s": {str(c): v for c, v in res["tokens_per_s"].items()},
            }
            if kind == draft_kind:
                if name in tau_before:
                    entry["before"] = tau_before[name]
                report["datasets"][name] = entry
            else:
                report["baselines"].setdefault(kind, {})[name] = entry
        report.setdefault("plain_tokens_per_s", {})[name] = {str(c): v for c, v in plain.items()}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    plot_acceptance(report, out)
    return report


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Evaluation report",
        "",
        f"- target: `{report['target']}`",
        f"- draft: `{report['draft']}`",
        f"- speculative_config: `{json.dumps(report['speculative_config'])}`",
        "",
        "| dataset | method | τ (records) | τ (vLLM) | speed-up by concurrency |",
        "|---|---|---|---|---|",
    ]

    def row(name: str, method: str, e: dict[str, Any]) -> str:
        sp = ", ".join(f"c={c}: {v:.2f}x" for c, v in e["speedup"].items())
        t = f"{e['tau']:.3f}" if e["tau"] is not None else "-"
        return f"| {name} | {method} | {t} | {e['tau_vllm']:.3f} | {sp} |"

    for name, e in report["datasets"].items():
        if "before" in e:
            b = e["before"]
            lines.append(
                f"| {name} | draft before (start of run) | {b['tau']:.3f} | {b['tau_vllm']:.3f} | - |"
            )
        lines.append(row(name, "draft", e))
        for b, per in report["baselines"].items():
            if name in per:
                lines.append(row(name, b, per[name]))
    return "\n".join(lines) + "\n"


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
        ax.set_title(f"{name}: τ {e['tau']:.2f} (vLLM {e['tau_vllm']:.2f})")
        fig.tight_layout()
        fig.savefig(out / f"acceptance_{name}.png", dpi=100)
        plt.close(fig)
