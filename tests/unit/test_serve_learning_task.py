"""The server's learning task (`serve/server.learn`) with stand-ins for the engine side and the learner: the traffic
is taken every poll while a learner step runs in its thread (requests close on time), a rollback asked for during
the step waits for it and drops its candidate, and the learner stops after `serve.max_versions` candidates."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from draft_opd_ray.config.schema import Config
from draft_opd_ray.serve import rollback
from draft_opd_ray.serve.server import Status, learn


class _Refitter:
    """What `learn` uses of `Refitter`: a take hands out one closed request per call for the first ``closed``."""

    def __init__(self, run_dir: Path, closed: int) -> None:
        self.cfg = Config()
        self.cfg.serve.poll_s, self.cfg.serve.guard = 0.01, False
        self.cfg.serve.requests_per_update, self.cfg.serve.max_versions = 1, 1
        self.status, self.run_dir, self.draft = Status(learning=True), run_dir, str(run_dir / "draft")
        self.takes, self.closed, self.decisions = 0, closed, []
        self.rollbacks: list[dict[str, Any]] = []

    async def take(self) -> list[Any]:
        self.takes += 1
        return ["a closed request"] if self.takes <= self.closed else []

    def decided(self, step: int, decision: str, **row: Any) -> None:
        self.decisions.append((step, decision, row))

    async def roll_back(self, learner: Any, feed: Any, request: dict[str, Any]) -> Any:
        self.rollbacks.append(request)
        return learner


class _Learner:
    """A step that blocks until the test lets it go and makes a candidate."""

    guard = None

    def __init__(self) -> None:
        self.started, self.go, self.steps = threading.Event(), threading.Event(), 0

    def step(self, batch: list[Any]) -> tuple[dict[str, float], dict[str, Any]]:
        self.started.set()
        assert self.go.wait(30)
        self.steps += 1
        return {"loss": 1.0}, {"fc.weight": "candidate"}


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_takes_go_on_while_a_step_runs_and_a_rollback_then_drops_its_candidate(tmp_path: Path) -> None:
    refitter, learner = _Refitter(tmp_path, closed=1), _Learner()

    async def main() -> None:
        task = asyncio.create_task(learn(refitter, learner))  # type: ignore[arg-type]
        try:
            await _until(learner.started.is_set)
            before = refitter.takes
            (tmp_path / rollback.REQUEST).write_text(json.dumps({"id": "r", "version": 0}))
            await _until(lambda: refitter.takes >= before + 5)  # the step still runs: takes go on
            assert rollback.waiting(tmp_path) and refitter.rollbacks == []  # waits for the step
            learner.go.set()
            await _until(lambda: refitter.rollbacks != [])
        finally:
            task.cancel()

    asyncio.run(main())
    assert refitter.decisions == [(1, "dropped", {"why": "a rollback was asked for"})]
    assert (
        refitter.rollbacks == [{"id": "r", "version": 0}] and not refitter.status.learning
    )  # max_versions 1
