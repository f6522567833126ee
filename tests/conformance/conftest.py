"""Fixtures of the GPU-conformance tier (tests/conformance): our vLLM engine arguments and extension points
checked against the installed vLLM's GPU-side code without a GPU and without starting an engine.

- `tiny_pair`: the tiny target and an EAGLE-3 head for it (real folders: vLLM's config reads them);
- `cuda_like`: vLLM's CPU platform class reporting CUDA and ``n`` GPUs, for the selection logic that asks
  `current_platform` (which executor, which backend);
- `llm_calls`: `vllm.LLM` replaced by a recorder, so that `SpecDecodeEngine` and `evaluate` hand over their
  engine arguments instead of starting an engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`SpecDecodeEngine` sets VLLM_CPU_KVCACHE_SPACE for the engine process it starts: undone after each test,
    so that no later test in the session inherits it."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    yield


@pytest.fixture(scope="package")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target folder, EAGLE-3 draft folder): the tiny random Llama and a fresh head on its layers 0-2."""
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.models.embedded import ensure_embedded_target
    from draft_opd_ray.models.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("conformance")
    target = build_tiny_target(root / "target", tokenizer_from=ensure_embedded_target())
    draft = save_eagle3(init_eagle3(target, aux_layer_ids=[0, 1, 2]), root / "eagle3", target)
    return target, Path(draft)


@pytest.fixture
def cuda_like() -> Callable[[int], Any]:
    """``cuda_like(n)``: a platform that says CUDA with ``n`` visible GPUs and Ray's "GPU" resource key; the rest
    is vLLM's CPU platform (nothing here touches a device)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum

    def make(n: int) -> Any:
        class CudaLike(CpuPlatform):
            _enum = PlatformEnum.CUDA
            ray_device_key = "GPU"

            @classmethod
            def device_count(cls) -> int:
                return n

        return CudaLike()

    return make


class Captured(Exception):
    """Raised by the recorder when asked to stop the caller right after the engine arguments are known."""


class LLMRecorder:
    """Stands in for `vllm.LLM`: keeps (model, keyword arguments) of each construction in ``calls``."""

    calls: list[tuple[str, dict[str, Any]]] = []
    stop = False

    def __init__(self, model: str, **kwargs: Any) -> None:
        type(self).calls.append((model, kwargs))
        if type(self).stop:
            raise Captured(model)


@pytest.fixture
def llm_calls(monkeypatch: pytest.MonkeyPatch) -> type[LLMRecorder]:
    """`vllm.LLM` recorded (``.calls``); set ``.stop = True`` to raise `Captured` at the first construction."""
    import vllm

    recorder = type("Recorder", (LLMRecorder,), {"calls": [], "stop": False})
    monkeypatch.setattr(vllm, "LLM", recorder)
    return recorder
