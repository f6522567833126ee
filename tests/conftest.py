"""Fixtures shared by every tier: one torch thread per test module, the embedded target, the tiny target built
from it, SFT trajectories and a replay case on the tiny target.

Tiers: `tests/unit` (no vLLM engine, Ray cluster or DeepSpeed engine; `make test-fast`), `tests/conformance`
(our engine arguments and extension points against the installed vLLM's GPU-side code, without a GPU or an
engine), `tests/integration` (marked `vllm`, `ray`, `deepspeed`), `tests/e2e` (marked `slow`; `make test-slow`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.models.embedded import ensure_embedded_target
from draft_opd_ray.models.tiny import build_tiny_target
from draft_opd_ray.wire import ReplayItem


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matrices: OpenMP hand-offs cost more than the math on a 2-core box (and vLLM needs the other core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ray_local(request: pytest.FixtureRequest) -> Iterator[None]:
    """A local Ray cluster of two CPUs for one test module, in a namespace named after it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace=request.module.__name__.rpartition(".")[2])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def embedded_target() -> Path:
    """The converted embedded SmolLM2 target in the default cache (converted on first use, then reused)."""
    return ensure_embedded_target()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory, embedded_target: Path) -> Path:
    """A tiny random Llama target (4 layers, hidden 64, head_dim 32) with the embedded target's tokenizer."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "target", tokenizer_from=embedded_target)


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two random SFT trajectories (8 prompt + 24 response tokens) in a Parquet file."""
    from draft_opd_ray.sft.data import Trajectory, _write

    g = torch.Generator().manual_seed(0)
    rows = [
        Trajectory(
            torch.randint(3, 300, (8,), generator=g).tolist(),
            torch.randint(3, 300, (24,), generator=g).tolist(),
        )
        for _ in range(2)
    ]
    path = tmp_path_factory.mktemp("traj") / "traj.parquet"
    _write(path, rows)
    return path


@dataclass
class ReplayCase:
    target: Path  # the tiny target
    eagle3: Path  # a fresh EAGLE-3 head on target layers (0, 1, 2)
    model: Any  # the target as an HF causal LM
    item: ReplayItem  # one greedy answer with five anchors (accepted 0..4, the rest of each block random)
    num_speculative_tokens: int

    def draft(self, kind: str, out: Path, num_layers: int = 1) -> Path:
        """A draft folder of ``kind`` for the tiny target (the EAGLE-3 head of the case, or a new one)."""
        from draft_opd_ray.drafts.dflash.model import init_dflash, save_dflash
        from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

        if kind == "eagle3":
            return self.eagle3
        if kind == "standalone":
            return build_standalone_from_target(self.target, out, num_layers=num_layers)
        return save_dflash(
            init_dflash(self.target, num_layers=num_layers, block_size=self.num_speculative_tokens + 1),
            out,
            self.target,
        )

    def replay(self, kind: str, draft: Path, **kwargs: Any) -> Any:
        """A replay actor shipping what ``kind``'s student needs (`DraftKind.replay_needs`: features, vocabulary)."""
        from draft_opd_ray.drafts.registry import draft_kind
        from tests.helpers import replay_actor

        feats, ids = draft_kind(kind).replay_needs(str(draft), str(self.target))
        return replay_actor(self.target, feats, ids, self.num_speculative_tokens, kind=kind, **kwargs)


@pytest.fixture(scope="module")
def replay_case(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> ReplayCase:
    from transformers import AutoModelForCausalLM

    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.rollout.reference import target_generate

    draft = save_eagle3(
        init_eagle3(tiny_target, aux_layer_ids=[0, 1, 2]), tmp_path_factory.mktemp("e3"), tiny_target
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    prompt = [1, 45, 900, 12, 7, 300]
    seq = prompt + target_generate(model, [prompt], max_new_tokens=24)[0]
    rng = random.Random(0)
    num_speculative_tokens = 4
    anchors, drafted, accepted = [], [], []
    for n, a in [(6, 0), (9, 2), (14, 4), (20, 1), (24, 3)]:  # (anchor position, accepted)
        y = seq[n + 1 : n + 1 + a] + [rng.randrange(100, 40000) for _ in range(num_speculative_tokens - a)]
        anchors.append(n)
        drafted.append(y[:num_speculative_tokens])
        accepted.append(a)
    return ReplayCase(
        tiny_target, draft, model, ReplayItem(seq, anchors, drafted, accepted, 0), num_speculative_tokens
    )
