"""SFT on the learner ranks: `cluster.learner_ranks` Ray actors forming one DeepSpeed data-parallel group.

The driver starts one :class:`SFTRank` per rank in the bundle the placement plan reserves for it
(``reservation.options(LEARNER, r)``; on a GPU cluster the bundle's GPU is the rank's device). Rank 0 reports the
rendezvous address; every rank runs `run_sft`: the feature cache first, the ranks sharing the target forward on
their devices (each writes every ``ranks``-th shard: `sft/features.py`), then its share of every global batch
(the same batches, schedule and budgets as one rank: `sft/trainer.py`), read lazily from the shards. Rank 0
writes the exports and checkpoints and keeps its metrics rows, which the driver collects while the ranks train
and logs in order. The ranks read the trajectories, write and read the feature cache and write the run
directory: on several nodes these must be on a shared file system.

On a CPU cluster Ray gives each actor OMP threads = its CPU share (often one); nothing else runs during SFT, so
each rank takes its node's cores divided by the ranks on that node.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draft_opd_ray.errors import RunError
from draft_opd_ray.placement import LEARNER, Reservation
from draft_opd_ray.waits import timeout_s, wait_for


class SFTRank:
    """One data-parallel rank of the SFT stage (a Ray actor; rank 0 with ``max_concurrency=2`` so that its rows
    can be collected while it trains)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def node(self) -> tuple[str, int]:
        """(Ray node id, usable cores of this process) where the rank runs."""
        import ray

        from draft_opd_ray.device import usable_cores

        return str(ray.get_runtime_context().get_node_id()), usable_cores()

    def address(self) -> tuple[str, int]:
        """Rank 0's rendezvous address for the group."""
        from draft_opd_ray.distributed import rendezvous_address

        return rendezvous_address()

    def train(
        self,
        master: tuple[str, int] | None,
        threads: int | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str:
        """`run_sft(*args, **kwargs)` as this rank; returns the final draft folder (rank 0's is the one written).
        ``threads``: torch threads, set here because OpenMP's count belongs to the thread that trains."""
        import torch

        from draft_opd_ray.distributed import release_process_group
        from draft_opd_ray.sft.trainer import DPRank, run_sft

        if threads:
            torch.set_num_threads(threads)
        try:
            out = run_sft(
                *args, **kwargs, metrics=self._keep, place=DPRank(self.rank, self.world_size, master)
            )
        finally:
            release_process_group()
        return str(out)

    def _keep(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._rows.append(row)

    def rows(self) -> list[dict[str, Any]]:
        """The metrics rows since the last call."""
        with self._lock:
            out, self._rows = self._rows, []
        return out


def rank_threads(nodes: list[tuple[str, int]]) -> list[int]:
    """Torch threads of each rank on a CPU cluster: its node's cores shared by the ranks on that node."""
    per_node: dict[str, int] = {}
    for n, _ in nodes:
        per_node[n] = per_node.get(n, 0) + 1
    return [max(1, cores // per_node[n]) for n, cores in nodes]


def run_sft_ranks(
    reservation: Reservation,
    ranks: int,
    *args: Any,
    metrics: Callable[[dict[str, Any]], None],
    cpu_threads: bool,
    poll_s: float = 2.0,
    **kwargs: Any,
) -> Path:
    """`run_sft(*args, **kwargs)` on ``ranks`` data-parallel Ray actors in the reservation's learner bundles;
    ``metrics`` gets rank 0's rows as they come. ``cpu_threads``: set each rank's torch threads from its node's
    cores (:func:`rank_threads`). The actors are gone when this returns (or raises: a failed rank ends all)."""
    import ray

    actors: list[Any] = [  # Ray's handles (untyped: methods are called through .remote)
        ray.remote(SFTRank)
        .options(**reservation.options(LEARNER, r), max_concurrency=2 if r == 0 else 1)
        .remote(r, ranks)
        for r in range(ranks)
    ]
    try:
        nodes = wait_for([a.node.remote() for a in actors], "sft ranks: start")
        threads = rank_threads(nodes) if cpu_threads else [None] * ranks
        master = wait_for(actors[0].address.remote(), "sft rank 0: rendezvous port") if ranks > 1 else None
        pending = [a.train.remote(master, t, args, kwargs) for a, t in zip(actors, threads)]
        final = pending[0]
        quiet_since = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
            wait_for(done, "sft ranks: train")  # a failed rank raises here; the others are ended below
            rows = wait_for(actors[0].rows.remote(), "sft rank 0: metrics rows")
            for row in rows:
                metrics(row)
            if rows or done:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > timeout_s():
                raise RunError(
                    f"sft ranks: no step finished in {timeout_s():.0f} s (cluster.actor_timeout_s); a rank is "
                    "stuck. The last complete checkpoint is kept: resume=<run dir> continues from it"
                )
        return Path(wait_for(final, "sft rank 0: export the draft"))
    finally:
        for a in actors:
            ray.kill(a)
