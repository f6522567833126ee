"""The draft module the refit and eval's weight swap act on (`DraftWeightExtension._draft_module`), reached the
way the runner the CUDA platform builds exposes it.

On CUDA, vLLM's worker builds Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`) when
`VllmConfig.use_v2_model_runner` holds (`vllm/config/vllm.py`), else V1 (`vllm/v1/worker/gpu_model_runner.py`);
V2 holds the draft in ``speculator`` and has no ``drafter``. Both, and the CPU runner, answer
`get_draft_model()`. Each runner here is the real class made with ``object.__new__`` and given only the attribute
its `get_draft_model` reads.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path
from typing import Any

import pytest
import torch


def _ext(runner: Any) -> Any:
    """A worker with our extension mixed in, as vLLM builds it, holding ``runner``."""
    from draft_opd_ray.sync.receiver import DraftWeightExtension

    ext = object.__new__(DraftWeightExtension)
    ext.model_runner = runner  # type: ignore[attr-defined]
    return ext


def _v2_runner(speculator: Any) -> Any:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.speculator = speculator
    return runner


def test_cuda_worker_builds_the_v1_or_v2_runner() -> None:
    """vllm/platforms/cuda.py (worker class), vllm/v1/worker/gpu_worker.py (`Worker._make_model_runner`): the
    CUDA worker is `gpu_worker.Worker`, which builds V2 or V1; both and the CPU runner have `get_draft_model`,
    V2 has no `drafter` (the attribute the extension used to read)."""
    import vllm.platforms
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1
    from vllm.v1.worker.gpu_worker import Worker

    cuda = (
        Path(vllm.platforms.__file__).parent / "cuda.py"
    ).read_text()  # imports CUDA kernels: read, not run
    assert '"vllm.v1.worker.gpu_worker.Worker"' in cuda
    make = inspect.getsource(Worker._make_model_runner)
    assert "vllm.v1.worker.gpu.model_runner" in make and "vllm.v1.worker.gpu_model_runner" in make
    for cls in (V1, V2, CPUModelRunner):
        assert callable(getattr(cls, "get_draft_model", None)), cls
    assert "self.drafter" not in inspect.getsource(V2)
    assert "self.speculator" in inspect.getsource(V2.get_draft_model)


def test_draft_module_from_model_runner_v2() -> None:
    """vllm/v1/worker/gpu/model_runner.py (`get_draft_model`), vllm/v1/worker/gpu/spec_decode/speculator.py:
    V2's draft is its `DraftModelSpeculator`'s ``model`` (EAGLE-3's speculator here)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    draft = torch.nn.Linear(4, 4)
    speculator = object.__new__(EagleSpeculator)
    speculator.model = draft
    assert _ext(_v2_runner(speculator))._draft_module() is draft


def test_draft_module_from_model_runner_v1_unwraps_cuda_graphs() -> None:
    """vllm/v1/worker/gpu_model_runner.py (`get_draft_model`), vllm/compilation/cuda_graph.py: V1 on CUDA may
    wrap the drafter's model in a `CUDAGraphWrapper`; the draft module is the model inside it."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    draft = torch.nn.Linear(4, 4)
    wrapped = object.__new__(CUDAGraphWrapper)
    wrapped.runnable = draft
    runner = object.__new__(GPUModelRunner)
    runner.drafter = types.SimpleNamespace(model=wrapped)
    assert _ext(runner)._draft_module() is draft


def test_draft_module_from_cpu_runner_and_a_runner_without_the_method() -> None:
    """vllm/v1/worker/cpu_model_runner.py (a V1 runner): the draft through `get_draft_model`; a runner without
    that method (older vLLM) still gives V1's ``drafter.model``."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    draft = torch.nn.Linear(4, 4)
    runner = object.__new__(CPUModelRunner)
    runner.drafter = types.SimpleNamespace(model=draft)
    assert _ext(runner)._draft_module() is draft
    assert _ext(types.SimpleNamespace(drafter=types.SimpleNamespace(model=draft)))._draft_module() is draft


def test_no_draft_model_is_a_clear_error() -> None:
    """vllm/v1/worker/gpu/model_runner.py: V2 without a draft-model speculator (plain decoding, ngram) has no
    draft: the extension says so and names the runner."""
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    for speculator in (None, object.__new__(NgramGPUSpeculator)):
        with pytest.raises(RuntimeError, match="no draft model to update: its GPUModelRunner serves none"):
            _ext(_v2_runner(speculator))._draft_module()
