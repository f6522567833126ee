"""Where a GPU server's pieces run: vLLM's engine on the first GPUs, the learner's side on the others.

The server's engine is not a Ray actor: vLLM starts it in the server's process on the first
`cluster.rollout_tensor_parallel` GPUs this process sees. The learner's side (the replay actor, the learner rank
and the guard) are Ray actors, and a local Ray hands out every GPU it was started with, the engine's first. So a
local Ray is started on the GPUs the engine leaves (the engine's own when it leaves none: one GPU shared by all, with
fractional shares as in `+cluster=gpu_shared`), and the shares must fit on them before any model loads.
A joined Ray cluster (`cluster.ray_address`, `RAY_ADDRESS`) places the actors itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import ConfigError


@dataclass(frozen=True)
class GpuSplit:
    engine: list[str]  # the GPU ids (as CUDA_VISIBLE_DEVICES names them) vLLM's engine takes
    ray: list[str]  # the ids the local Ray is started with: the learner's side
    shares: dict[str, float]  # the learner side's actors and their GPU shares

    @property
    def shared(self) -> bool:
        """The learner's side shares the engine's GPU(s) (then the engine keeps to rollout.gpu_memory_utilization)."""
        return bool(set(self.engine) & set(self.ray))

    def describe(self) -> str:
        side = ", ".join(f"{k} {v:g}" for k, v in self.shares.items())
        where = "sharing the engine's" if self.shared else "of their own"
        return f"GPUs: vLLM's engine on {self.engine}; the learner's side ({side} GPU) on {self.ray}, {where}"


def visible_gpus(cfg: Config) -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when set, else `cluster.gpus_per_node` of them."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [g.strip() for g in env.split(",") if g.strip()]
    return [str(i) for i in range(cfg.cluster.gpus_per_node)]


def learner_shares(cfg: Config) -> dict[str, float]:
    """The GPU share of each actor beside the server (the guard's two drafts take the replay actor's share)."""
    c = cfg.cluster
    shares = {"replay": c.gpus_per_replay, "learner": c.gpus_per_learner}
    if cfg.serve.guard:
        shares["guard"] = c.gpus_per_replay
    return shares


def split_gpus(visible: list[str], tensor_parallel: int, shares: dict[str, float]) -> GpuSplit:
    """The engine on the first ``tensor_parallel`` of ``visible``, the learner's side on the rest (on the engine's
    when there is no rest); a ConfigError when the engine's GPUs are missing or the shares do not fit (each actor
    on one GPU: a share of 1 or more takes that many whole GPUs, fractions pack first-fit)."""
    if len(visible) < tensor_parallel:
        raise ConfigError(
            f"cluster.rollout_tensor_parallel: the server's engine needs {tensor_parallel} GPUs and this machine "
            f"shows {len(visible)} ({visible}; CUDA_VISIBLE_DEVICES or cluster.gpus_per_node)"
        )
    engine = visible[:tensor_parallel]
    rest = visible[tensor_parallel:] or engine
    free = [1.0] * len(rest)
    for name, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        if share >= 1:
            whole = [i for i, f in enumerate(free) if f == 1.0][: int(share)]
            if len(whole) < int(share) or share != int(share):
                raise _no_fit(shares, rest, name)
            for i in whole:
                free[i] = 0.0
            continue
        at = next((i for i, f in enumerate(free) if f >= share - 1e-9), None)
        if at is None:
            raise _no_fit(shares, rest, name)
        free[at] -= share
    return GpuSplit(engine, rest, dict(shares))


def _no_fit(shares: dict[str, float], gpus: list[str], name: str) -> ConfigError:
    got = ", ".join(f"{k} {v:g}" for k, v in shares.items())
    return ConfigError(
        f"cluster.gpus_per_{'learner' if name == 'learner' else 'replay'}: the learner's side beside the server "
        f"({got} GPU) does not fit on the GPUs the engine leaves ({gpus}); use fractions (as +cluster=gpu_shared "
        "does) or more GPUs"
    )


def serve_split(cfg: Config) -> GpuSplit | None:
    """The split for ``cfg``: None on CPU, or when the actors go to a joined Ray cluster (RAY_ADDRESS or
    `cluster.ray_address`, "auto" included: `cluster.resolve_address`'s rule, without looking the cluster up)."""
    joined = os.environ.get("RAY_ADDRESS") or cfg.cluster.ray_address
    if cfg.cluster.gpus_per_node == 0 or joined not in (None, "", "local"):
        return None
    return split_gpus(visible_gpus(cfg), cfg.cluster.rollout_tensor_parallel, learner_shares(cfg))
