"""τ, measured one way everywhere: the eval report, the vLLM-vs-reference check and the benchmarks use this.

τ of a set of requests = committed response tokens / verification steps (docs/design.md, "Records"), from the
project's anchor records (`tau`) and from vLLM's own per-request spec-decode counters (`tau_vllm`). Requests that
failed are left out; with no verification step at all (plain decoding) `tau` falls back to `tau_vllm`.
`per_prompt` gives each request's counts from the same source, so τ's uncertainty (`eval/stats.py`) can be
computed from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.eval.stats import bootstrap_ci
from draft_opd_ray.rollout.records import tau, tau_vllm
from draft_opd_ray.wire import RequestRecord


def tau_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    recs = [r for r in records if not r.error]
    stepped = any(r.num_steps for r in recs)
    t_vllm = tau_vllm(recs)
    return {
        "tau": tau(recs) if stepped else t_vllm,
        "tau_vllm": t_vllm,
        "tokens": float(sum(len(r.response_ids) for r in recs)),
        "requests": float(len(recs)),
    }


def per_prompt(records: Sequence[RequestRecord]) -> list[dict[str, int]]:
    """``{"steps", "accepted", "tokens"}`` of each request, in order, counted where `tau_stats` counts: the
    anchor records when any successful request has a verification step, else vLLM's counters. A failed
    request counts zero of each."""
    stepped = any(r.num_steps for r in records if not r.error)
    out = []
    for r in records:
        if r.error:
            out.append({"steps": 0, "accepted": 0, "tokens": 0})
        elif stepped:
            out.append({"steps": r.num_steps, "accepted": sum(r.accepted), "tokens": len(r.response_ids)})
        else:
            steps, accepted = max(r.vllm_steps, 0), max(r.vllm_accepted, 0)
            out.append({"steps": steps, "accepted": accepted, "tokens": len(r.response_ids)})
    return out


def tau_entry(stats: dict[str, float], records: Sequence[RequestRecord]) -> dict[str, Any]:
    """τ of one method on one eval set: `tau`, `tau_vllm`, `n` (requests with a verification step), `tau_ci`
    (95% bootstrap CI over prompts) and `per_prompt` (every request's counts, in prompt order)."""
    counts = per_prompt(records)
    ci = bootstrap_ci(counts)
    return {
        "tau": stats["tau"],
        "tau_vllm": stats["tau_vllm"],
        "n": ci["n"],
        "tau_ci": [ci["lo"], ci["hi"]],
        "per_prompt": counts,
    }


def measure_all(
    engine: Any, prompts: Sequence[list[int]], sampling: Any
) -> tuple[dict[str, float], list[RequestRecord]]:
    """Like `measure`, but returns every record, one per prompt in prompt order (failed ones included)."""
    recs = list(engine.generate(prompts, sampling))
    return tau_stats(recs), recs


def measure(
    engine: Any, prompts: Sequence[list[int]], sampling: Any
) -> tuple[dict[str, float], list[RequestRecord]]:
    """Generate ``prompts`` with ``engine`` (a `SpecDecodeEngine`); τ statistics and the successful records."""
    stats, recs = measure_all(engine, prompts, sampling)
    return stats, [r for r in recs if not r.error]


def check_swap(engine: Any, weights: dict[str, Any], version: int, first: set[str], where: str) -> None:
    """Raise `RefitError` unless the engine now serves ``weights``: a draft must hold every tensor the engine's
    first draft held (vLLM keeps a layer's old values where the file has no tensor for it, with a log line only),
    and the engine's fingerprints of what it serves must be those of ``weights`` (`sync.refit.check_ack`)."""
    import torch

    from draft_opd_ray.errors import RefitError
    from draft_opd_ray.sync.refit import check_ack, fingerprints

    if missing := sorted(first - set(weights)):
        raise RefitError(
            f"{where}: lacks {len(missing)} tensors the first draft has ({', '.join(missing[:3])}): a swap would "
            "keep the previous draft's values there"
        )
    ack = engine.refit_ack(f"eval engine, draft {where}")
    check_ack(ack, version, {ack.dtype: fingerprints(weights.items(), getattr(torch, ack.dtype))})


def measure_drafts(
    target: str | os.PathLike[str],
    kind: str,
    drafts: Sequence[str | os.PathLike[str]],
    prompts: Sequence[list[int]],
    *,
    num_speculative_tokens: int,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    max_model_len: int = 2048,
    on_measured: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """τ of several drafts of one kind (and vocabulary) on the same prompts, greedy, in ONE vLLM engine: after
    the first, each draft's weights are swapped in (`load_draft_weights`) and checked (`check_swap`: the same
    tensor names as the first draft, and the engine's refit proof of their values). Keyed by the draft folder; each
    value is a `tau_entry` (τ, n, 95% CI, per-prompt counts). ``on_measured(draft, entry)`` is called as each
    draft is done (a caller that keeps them loses none to a stop mid-list). ``stop_token_ids``: the ids that
    end an answer (None: the target's eos ids, `models.target.stop_token_ids`)."""
    from safetensors.torch import load_file

    from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.models.target import target_stop_token_ids
    from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine, all_cores

    stop = tuple(stop_token_ids) if stop_token_ids is not None else target_stop_token_ids(target)
    sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=stop)
    out: dict[str, dict[str, float]] = {}
    run = EngineRun(str(target), kind, str(drafts[0]), cpu_bind=all_cores())  # alone: on CPU, every core
    engine = SpecDecodeEngine(
        run,
        DraftConfig(kind=kind, num_speculative_tokens=num_speculative_tokens),
        TargetConfig(max_model_len=max_model_len),
        RolloutConfig(),
    )
    first: set[str] = set()
    try:
        for v, path in enumerate(drafts):
            if v == 0:
                first = set(load_file(str(Path(path) / "model.safetensors")))
            else:
                weights = load_file(str(Path(path) / "model.safetensors"))
                engine.load_draft_weights(weights, v)
                check_swap(engine, weights, v, first, str(path))
            stats, recs = measure_all(engine, prompts, sampling)
            out[str(path)] = tau_entry(stats, recs)
            if on_measured is not None:
                on_measured(str(path), out[str(path)])
            print(
                f"[tau] {path}: τ {out[str(path)]['tau']:.3f} (vLLM {out[str(path)]['tau_vllm']:.3f})",
                flush=True,
            )
    finally:
        engine.shutdown()
    return out
