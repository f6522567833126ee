"""Async scheduling against anchor recording.

On CUDA, `VllmConfig` turns async scheduling on by default for eagle3 / draft_model / dflash
(`vllm/config/vllm.py`, `__post_init__`); then the engine core hands drafts to the scheduler only through
`AsyncScheduler`'s path (`vllm/v1/engine/core.py`: `update_draft_token_ids` only when not async) and the
scheduled drafts are -1 placeholders (`vllm/v1/core/sched/async_scheduler.py`). A recording engine therefore
passes ``async_scheduling=False``; our scheduler refuses an async config and a step with placeholder drafts.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import vllm.platforms

from tests.helpers import spec_engine


@pytest.fixture
def cuda_async_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`VllmConfig` resolving async scheduling as on CUDA: the generic resolution in `config/vllm.py` runs as is;
    only the CPU platform's later override (`platforms/cpu.py`: async off, "not required on CPU") is undone.
    CUDA's platform hook leaves the setting alone (checked on the text of `platforms/cuda.py`)."""
    from vllm.platforms.cpu import CpuPlatform

    cuda = (Path(vllm.platforms.__file__).parent / "cuda.py").read_text()
    assert "async_scheduling" not in cuda
    cpu_hook = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_async(cls: Any, cfg: Any) -> None:
        resolved = cfg.scheduler_config.async_scheduling
        cpu_hook(cls, cfg)
        cfg.scheduler_config.async_scheduling = resolved

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async))


def _config(model: str, kwargs: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, **kwargs).create_engine_config()


def test_recording_engine_runs_synchronous_on_cuda(
    tiny_pair: tuple[Path, Path], llm_calls: Any, cuda_async_default: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm/config/vllm.py (`VllmConfig.__post_init__`), vllm/config/scheduler.py (`get_scheduler_cls`): our
    recording engine's arguments (captured from `SpecDecodeEngine`) give a config with async scheduling off and
    our scheduler class; the same engine not recording, on CUDA's default, runs async (eval speed runs keep
    vLLM's default)."""
    from draft_opd_ray.rollout.vllm_ext import AnchorRecordingScheduler

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    target, draft = tiny_pair
    for record in (True, False):
        spec_engine(target, "eagle3", draft, 3, max_model_len=128, record=record)
    (m1, recording), (m2, plain) = llm_calls.calls
    cfg = _config(m1, recording)
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.scheduler_config.get_scheduler_cls() is AnchorRecordingScheduler
    assert _config(m2, plain).scheduler_config.async_scheduling is True
    # what the recording engine would get without its explicit setting: async, which our scheduler refuses
    default = _config(m1, {k: v for k, v in recording.items() if k != "async_scheduling"})
    assert default.scheduler_config.async_scheduling is True
    with pytest.raises(ValueError, match="anchor recording needs async_scheduling=False"):
        AnchorRecordingScheduler(vllm_config=default)


def test_placeholder_drafts_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm/v1/core/sched/async_scheduler.py (-1 placeholders), vllm/v1/core/sched/output.py,
    vllm/v1/outputs.py: a step whose scheduled drafts are placeholders raises instead of recording a step
    of drafts that never existed (the parent's bookkeeping is left out: only our recording is under test)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput

    from draft_opd_ray.rollout.vllm_ext import AnchorRecordingScheduler

    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, so, mro: {})
    sched = object.__new__(AnchorRecordingScheduler)
    sched.requests = {"r": types.SimpleNamespace(num_output_tokens=3, sampling_params=None)}
    sched._steps = {}
    runner_out = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7]])
    real = dataclasses.replace(SchedulerOutput.make_empty(), scheduled_spec_decode_tokens={"r": [5, 6, 9]})
    sched.update_from_output(real, runner_out)
    assert sched._steps == {"r": [(3, [5, 6, 9], 0, [])]}
    held = dataclasses.replace(SchedulerOutput.make_empty(), scheduled_spec_decode_tokens={"r": [-1, -1, -1]})
    with pytest.raises(RuntimeError, match=r"request r: .* async-scheduling placeholders \(-1\)"):
        sched.update_from_output(held, runner_out)
