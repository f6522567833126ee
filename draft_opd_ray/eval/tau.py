"""τ, measured one way everywhere: the eval report, the vLLM-vs-reference check and the benchmarks use this.

τ of a set of requests = committed response tokens / verification steps (docs/design.md, "Records"), from the
project's anchor records (`tau`) and from vLLM's own per-request spec-decode counters (`tau_vllm`). Requests that
failed are left out; with no verification step at all (plain decoding) `tau` falls back to `tau_vllm`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.rollout.records import RequestRecord, tau, tau_vllm


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


def measure(
    engine: Any, prompts: Sequence[list[int]], sampling: Any
) -> tuple[dict[str, float], list[RequestRecord]]:
    """Generate ``prompts`` with ``engine`` (a `SpecDecodeEngine`); τ statistics and the successful records."""
    recs = [r for r in engine.generate(prompts, sampling) if not r.error]
    return tau_stats(recs), recs


def measure_drafts(
    target: str | os.PathLike[str],
    kind: str,
    drafts: Sequence[str | os.PathLike[str]],
    prompts: Sequence[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    max_model_len: int = 2048,
) -> dict[str, dict[str, float]]:
    """τ of several drafts of one kind (and vocabulary) on the same prompts, greedy, in ONE vLLM engine: after
    the first, each draft's weights are swapped in (`load_draft_weights`). Keyed by the draft folder."""
    from safetensors.torch import load_file

    from draft_opd_ray.rollout.engine import Sampling, SpecDecodeEngine

    sampling = Sampling(
        max_new_tokens=max_new_tokens, stop_token_ids=(eos_token_id,) if eos_token_id is not None else ()
    )
    out: dict[str, dict[str, float]] = {}
    engine = SpecDecodeEngine(
        str(target),
        draft_kind=kind,
        draft_path=str(drafts[0]),
        num_speculative_tokens=k,
        max_model_len=max_model_len,
    )
    try:
        for v, path in enumerate(drafts):
            if v > 0:
                engine.load_draft_weights(load_file(str(Path(path) / "model.safetensors")), v)
            out[str(path)], _ = measure(engine, prompts, sampling)
            print(
                f"[tau] {path}: τ {out[str(path)]['tau']:.3f} (vLLM {out[str(path)]['tau_vllm']:.3f})",
                flush=True,
            )
    finally:
        engine.shutdown()
    return out
