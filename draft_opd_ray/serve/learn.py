"""The learner beside a server: the same replay actor and DeepSpeed learner rank the Draft-OPD loop uses
(`loop/actors.py`), fed with the server's traffic instead of rollouts.

A step takes the closed requests (`serve/traffic.py`), selects anchors as the loop does (`loop.opd.replay_items`),
turns the captured teacher into training items on the replay actor (with `teacher.source=verify` and the captured
feature rows, no target forward), runs `learner.mini_batches` updates, and returns the new draft's weights for the
server to refit. Its calls block on Ray: the server runs them in a thread, so requests are served meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.wire import RequestRecord

MOMENTS = "optimizer.pt"  # in checkpoints/serve/: the learner's optimizer state at the last published version


def moments(root: Path, version: int) -> Any:
    """The optimizer state saved with the published ``version`` (`TrafficLearner.save_moments`), or None when the
    one on disk belongs to another version (a rollback went further back) or there is none."""
    from draft_opd_ray.checkpoint import load_state

    path = root / MOMENTS
    if not path.is_file():
        return None
    saved = load_state(path)
    return saved if int(saved.get("version", -1)) == version else None


class TrafficLearner:
    def __init__(self, cfg: Config, target: str, draft_dir: str) -> None:
        """A replay actor, one learner rank and the guard on the connected Ray, started from the served draft; the
        learner's schedule lasts `serve.max_versions` steps of `learner.mini_batches` updates."""
        self.cfg, self.target = cfg, target
        self.steps = 0  # candidates made (a restarted learner goes on counting)
        self.restarts = 0
        self._start(draft_dir)

    def _start(self, draft_dir: str) -> None:
        import ray

        from draft_opd_ray.loop.actors import (
            LearnerGroup,
            ReplayGroup,
            start_learner_ranks,
            start_replay_actor,
        )
        from draft_opd_ray.opd.learner import LearnerRun
        from draft_opd_ray.serve.guard import GuardActor
        from draft_opd_ray.serve.placement import learner_shares

        cfg, target = self.cfg, self.target
        # no bundles: the server's engine is not a Ray actor, so there is no plan to place these in; on GPUs each
        # takes its share of the GPUs the local Ray was started on (`serve/placement.py`: the engine's are not)
        gpus = learner_shares(cfg) if cfg.cluster.gpus_per_node > 0 else {}

        def options(name: str) -> dict[str, Any]:
            return {"num_cpus": 0, "num_gpus": gpus.get(name, 0)}

        self.replay = ReplayGroup([start_replay_actor(cfg, target, draft_dir, options("replay"), None)])
        run = LearnerRun(
            draft_dir,
            target,
            cfg.serve.max_versions * cfg.learner.mini_batches * cfg.learner.epochs,
            num_threads=None if cfg.cluster.gpus_per_node > 0 else 1,
        )
        ranks = start_learner_ranks(
            1, lambda r: options("learner"), run, (cfg.draft, cfg.loss, cfg.optim, cfg.learner)
        )
        self.learner = LearnerGroup(ranks)
        self.guard: Any = None
        if cfg.serve.guard:
            self.guard = (
                ray.remote(GuardActor)
                .options(**options("guard"))
                .remote(cfg.draft.kind, draft_dir, target, cfg.draft.num_speculative_tokens)
            )

    def restart(self, draft_dir: str, failed: bool = True, moments: Any = None) -> None:
        """A learner that failed (an actor died, a step timed out; ``failed``, counted in `restarts`), or one whose
        server rolled back, comes back from ``draft_dir``, the draft the server serves: every actor started again
        from it, the optimizer from ``moments`` (`save_moments` of that version; None: they start over)."""
        import contextlib

        import ray

        for actor in [*self.replay.actors, *self.learner.ranks, self.guard]:
            if actor is not None:
                with contextlib.suppress(Exception):  # already dead: nothing to stop
                    ray.kill(actor)
        self.restarts += int(failed)
        self._start(draft_dir)
        if moments is not None:
            self.learner.load_optimizer_states(moments["ranks"])

    def save_moments(self, root: Path, version: int) -> None:
        """The learner's optimizer state (moments, schedule) as the published ``version`` left it, in
        ``root/optimizer.pt``, replacing the previous version's (atomically): what a restart from that version's
        draft continues with (`moments`)."""
        import os

        import torch

        tmp = root / f".{MOMENTS}.tmp"
        torch.save({"version": version, "ranks": self.learner.optimizer_states()}, tmp)
        os.replace(tmp, root / MOMENTS)

    def judge(self, held: Sequence[RequestRecord], weights: dict[str, Any]) -> Any:
        """The guard's decision on a candidate (`serve/guard.py`), from the held-back requests ``held``."""
        from draft_opd_ray.serve.guard import decide
        from draft_opd_ray.waits import wait_for

        assert self.guard is not None
        got = wait_for(self.guard.score.remote(list(held), weights), "guard: score a candidate")
        return decide(got["candidate"], got["serving"], self.cfg.serve.guard_margin)

    def published(self) -> None:
        """The candidate the guard last scored is now served."""
        from draft_opd_ray.waits import wait_for

        if self.guard is not None:
            wait_for(self.guard.publish.remote(), "guard: take the published draft")

    def step(self, records: Sequence[RequestRecord]) -> tuple[dict[str, float], dict[str, Any]]:
        """One Draft-OPD step on ``records``: the learner's row of sums, and the new weights (checkpoint names)."""
        from draft_opd_ray.loop.opd import replay_items
        from draft_opd_ray.waits import wait_for

        items = replay_items(records, self.cfg, seed=self.cfg.anchor.seed + self.steps)
        if not items:
            return {"skipped": 1.0}, {}
        teacher = self.replay.score(items)
        row = self.learner.step(teacher, self.cfg.learner.mini_batches, self.cfg.learner.epochs)
        self.steps += 1
        row["anchors"] = float(sum(len(it.anchor_pos) for it in items))
        if "skipped" in row:
            return row, {}
        return row, wait_for(self.learner.rank0.rollout_state.remote(), "learner rank 0: weights")
