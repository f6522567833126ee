"""Which engines evaluation starts: τ comes from a recording engine (synchronous scheduling, the anchor
records), and on GPUs, where vLLM schedules asynchronously by default, the speed runs get an engine that does
not record, so tokens/s is measured as vLLM serves (the plain target never records). The engine is a stand-in
that keeps what it was built with and what it ran: this checks evaluate's plan, not vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from draft_opd_ray.config.schema import ClusterConfig, DraftConfig, EvalConfig, RolloutConfig, TargetConfig
from draft_opd_ray.eval import evaluate as ev
from draft_opd_ray.wire import RequestRecord


class _Engine:
    built: list[_Engine] = []

    def __init__(self, run: Any, draft: Any, target: Any, rollout: Any) -> None:
        self.kind, self.record = run.draft_kind, run.record and run.draft_kind != "none"
        self.runs: list[int] = []  # prompts per generate call
        self.target = target
        type(self).built.append(self)

    def generate(self, prompts: Any, sampling: Any) -> list[RequestRecord]:
        self.runs.append(len(prompts))
        return [
            RequestRecord(list(p), [5, 6, 7], accepted=[1, 0] if self.record else [], finish_reason="length")
            for p in prompts
        ]

    def load_draft_weights(self, weights: Any, version: int) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("gpu", [True, False])
def test_speed_runs_use_vllm_default_scheduling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpu: bool
) -> None:
    monkeypatch.setattr(_Engine, "built", [])
    monkeypatch.setattr(ev, "SpecDecodeEngine", _Engine)
    monkeypatch.setattr(ev, "async_by_default", lambda: gpu)
    prompts = [[1, 2, 3]] * 4
    ev.evaluate(
        ev.EvalRun("t", "draft", {"a": prompts}, tmp_path, (), speed_prompts=4),
        EvalConfig(max_new_tokens=3, concurrency=[1], baselines=[]),
        DraftConfig(kind="eagle3", num_speculative_tokens=2),
        TargetConfig(dtype="bfloat16"),
        RolloutConfig(),
        ClusterConfig(),
    )
    built = [(e.kind, e.record) for e in _Engine.built]
    if gpu:  # the draft: τ recorded, then speed on a non-recording engine; the plain target never records
        assert built == [("eagle3", True), ("eagle3", False), ("none", False)]
        recording, serving = _Engine.built[:2]
        assert recording.runs == [4] and serving.runs == [1] * 5  # τ; then warm-up + 4 speed runs at c=1
    else:  # CPU: vLLM is synchronous anyway, one engine measures both
        assert built == [("eagle3", True), ("none", False)]
        assert _Engine.built[0].runs == [4] + [1] * 5
    assert all(e.target.dtype == "bfloat16" for e in _Engine.built)
