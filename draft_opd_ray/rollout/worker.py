"""RolloutWorker: a Ray actor holding one vLLM engine (target + current draft) that turns prompts into
anchor records, and swaps draft weights between generation rounds.

Ray runs an actor's calls one at a time in submission order, so a `load_draft_weights` submitted while a
round is generating takes effect after that round and before the next: records never mix versions within
a round, and each record carries the version that proposed it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
from draft_opd_ray.rollout.engine import EngineRun, Sampling, SpecDecodeEngine
from draft_opd_ray.sync.refit import RefitAck
from draft_opd_ray.wire import RequestRecord


class RolloutWorker:
    def __init__(
        self, rank: int, run: EngineRun, draft: DraftConfig, target: TargetConfig, rollout: RolloutConfig
    ) -> None:
        """Worker ``rank``'s engine (`SpecDecodeEngine`: ``run`` and the configs), seeded ``run.seed + rank``.
        ``run.tensor_parallel``: GPUs of this engine (the actor owns them, the engine runs its ranks as local
        processes); ``run.weight_transfer="nccl"`` readies the engine for `NcclWeightSync` (vLLM's
        weight-transfer engine); `target.dtype` as configured (``auto`` is resolved by the engine, on this actor's
        node). ``run.cpu_bind`` binds the whole actor process (CPU engines: each worker its own core)."""
        if (
            run.cpu_bind is not None
        ):  # CPU engines: give each worker its own core instead of all binding core 0
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = run.cpu_bind
        self.rank = rank
        engine_run = dataclasses.replace(run, seed=run.seed + rank, cpu_bind=None)  # bound above, for good
        self.engine = SpecDecodeEngine(engine_run, draft, target, rollout)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[RequestRecord]:
        return self.engine.generate(prompts, sampling)

    def load_draft_weights(self, weights: dict[str, Any], version: int) -> int:
        self.engine.load_draft_weights(weights, version)
        return version

    def load_draft_weights_file(self, path: str, version: int) -> int:
        self.engine.load_draft_weights_file(path, version)
        return version

    def refit_ack(self) -> RefitAck:
        """The refit proof of the weights it serves now (`sync/refit.py`)."""
        return self.engine.refit_ack(f"rollout worker {self.rank}")

    def nccl_init(self, address: str, port: int, rank_offset: int, world_size: int) -> int:
        """Join the learner's NCCL group as ranks ``rank_offset..`` (one per engine rank); blocks until all did."""
        self.engine.nccl_init(address, port, rank_offset, world_size)
        return self.rank

    def load_draft_weights_nccl(self, plan: dict[str, list[Any]], version: int) -> int:
        """Receive the tensors of ``plan`` (`sync.nccl.nccl_plan`) from the learner's broadcast."""
        self.engine.load_draft_weights_nccl(plan, version)
        return version

    def set_version(self, version: int) -> int:
        """The version of the weights the engine was started with (a resumed run starts from version n)."""
        self.engine.version = version
        return version

    def version(self) -> int:
        return self.engine.version

    def speculative_config(self) -> dict[str, Any] | None:
        return self.engine.spec_config

    def shutdown(self) -> None:
        self.engine.shutdown()
