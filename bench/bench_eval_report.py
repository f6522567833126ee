"""P0 and P7 from a finished run's eval report: the raw file of a number that `python -m draft_opd_ray.main`
measures itself (its eval stage), so no bench script of its own re-measures it.

    python -m draft_opd_ray.main stages=[sft,eval] sft.curve_minutes=[10,20]    # P0: the SFT warm start
    python bench/bench_eval_report.py P0 outputs/<date>/<time>
    make run                                                                    # P7: the default run
    python bench/bench_eval_report.py P7 outputs/<date>/<time>

Reads <run dir>/eval/report.json (draft_opd_ray/eval/evaluate.py) and writes results/bench/<id>.json (`--out`;
format: results/README.md), with the run's Hydra overrides (<run dir>/.hydra/overrides.yaml) beside the raw
numbers:
    P0  τ of the draft (vLLM's counters) on `--set`, vLLM's ngram τ on the same prompts beside it; target >= 1.8
    P7  served speed-up over plain decoding at each concurrency, ngram's beside it; target >= 1.5 at batch 1 and
        above ngram
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _results import add_result_args, write_result


def p0(entry: dict, ngram: dict | None) -> tuple[float, bool, dict]:
    value = round(entry["tau_vllm"], 3)
    raw = {k: entry.get(k) for k in ("tau", "tau_vllm", "n", "tau_ci", "acceptance_per_position", "speedup")}
    raw["per_prompt"] = entry.get("per_prompt")
    raw["ngram"] = {k: ngram.get(k) for k in ("tau_vllm", "speedup")} if ngram else None
    return value, value >= 1.8, raw


def p7(entry: dict, ngram: dict | None) -> tuple[dict, bool, dict]:
    value = {c: round(v, 2) for c, v in entry["speedup"].items()}
    ngram_speedup = ngram["speedup"] if ngram else None
    met = value.get("1", 0.0) >= 1.5 and (ngram_speedup is None or value.get("1", 0.0) > ngram_speedup["1"])
    raw = {"speedup": entry["speedup"], "tokens_per_s": entry["tokens_per_s"], "tau_vllm": entry["tau_vllm"]}
    raw |= {"n": entry.get("n"), "ngram_speedup": ngram_speedup}
    raw["ngram_tau_vllm"] = ngram.get("tau_vllm") if ngram else None
    return value, met, raw


def _label(path: str | None) -> str | None:
    """A draft path as a label: relative to the working dir where it is inside it, else its last three parts (the
    result file names no machine's paths)."""
    if not path:
        return path
    p = Path(path)
    return str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(Path(*p.parts[-3:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("id", choices=["P0", "P7"])
    ap.add_argument(
        "run_dir", type=Path, help="the run dir of `python -m draft_opd_ray.main ...` (with eval/)"
    )
    ap.add_argument("--set", default="mtbench", help="the eval set the line quotes")
    add_result_args(ap)
    args = ap.parse_args()
    report = json.loads((args.run_dir / "eval" / "report.json").read_text())
    entry = report["datasets"][args.set]
    ngram = report.get("baselines", {}).get("ngram", {}).get(args.set)
    value, met, raw = (p0 if args.id == "P0" else p7)(entry, ngram)
    overrides = args.run_dir / ".hydra" / "overrides.yaml"
    spec = report.get("speculative_config") or {}
    raw |= {"set": args.set, "draft": _label(report.get("draft")), "method": spec.get("method")}
    raw["num_speculative_tokens"] = spec.get("num_speculative_tokens")
    raw["run_overrides"] = overrides.read_text() if overrides.is_file() else None
    target = ">= 1.8" if args.id == "P0" else ">= 1.5 at concurrency 1 and above ngram"
    write_result(args, args.id, value=value, target=target, met=met, raw=raw)
    print(f"{args.id} {json.dumps(value)} (target {target}: {'met' if met else 'NOT met'})")


if __name__ == "__main__":
    main()
