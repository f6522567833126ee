"""Killed actors, one per run: `kill -9` of a rollout worker in the middle of a round, or of the replay actor in
the middle of scoring, at a random moment of a short run. Ray restarts it (`cluster.max_restarts`), the loop gives
it the current weights and redoes its lost work, the run completes, the restart is counted in the metrics, and
every anchor record in `anchors/` is counted once (the lost round is generated again, not lost and not taken
twice). A killed learner rank stops the run with one line naming the kept checkpoint, which a resume continues.
Slow: `make test-slow`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from draft_opd_ray.metrics import read_metrics
from draft_opd_ray.rollout.records import read_parquet
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray, pytest.mark.deepspeed]

STEPS = 4


def _overrides(target: Path, run_dir: Path) -> list[str]:
    return helpers.short_opd_run(target, run_dir, STEPS)


def _pids(title: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"ray::{title}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _opd_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(r["stage"] == "opd" for r in read_metrics(path)) if path.is_file() else 0


def _killer(run_dir: Path, title: str, after: int, killed: list[int], rng: random.Random) -> None:
    """Once ``after`` steps are logged, a random pause, then SIGKILL one process titled ``ray::<title>`` (Ray
    titles a busy actor's process `ray::<Class>.<method>`)."""
    deadline = time.monotonic() + 1200
    while _opd_steps(run_dir) < after and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(rng.uniform(0.0, 2.0))
    while not (pids := _pids(title)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pids:
        pid = rng.choice(pids)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)


def _run_with_a_kill(target: Path, run_dir: Path, title: str, after: int) -> subprocess.CompletedProcess[str]:
    killed: list[int] = []
    t = threading.Thread(
        target=_killer, args=(run_dir, title, after, killed, random.Random(title)), daemon=True
    )
    t.start()
    r = helpers.run_main(*_overrides(target, run_dir), timeout=2400)
    t.join(timeout=60)
    assert len(killed) == 1, f"nothing titled ray::{title} was found to kill"
    return r


@pytest.mark.parametrize(
    "title,counter",
    [("RolloutWorker.generate", "rollout_restarts"), ("ReplayActor.score", "replay_restarts")],
)
def test_a_killed_actor_is_restarted_and_no_record_is_lost_or_used_twice(
    tiny_target: Path, tmp_path: Path, title: str, counter: str
) -> None:
    run_dir = tmp_path / "run"
    r = _run_with_a_kill(tiny_target, run_dir, title, after=1)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    assert rows[-1][counter] == 1, rows[-1]
    for m in rows:  # every record a step used is in anchors/ once, and only those
        recs = read_parquet(run_dir / "anchors" / f"step_{m['step'] - 1:05d}.parquet")
        assert len(recs) == m["records"] > 0, (m["step"], len(recs), m["records"])
    assert len(list((run_dir / "anchors").glob("*.parquet"))) == STEPS


def test_a_killed_learner_stops_the_run_with_one_line_and_a_usable_checkpoint(
    tiny_target: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    r = _run_with_a_kill(tiny_target, run_dir, "Learner.step_shards", after=2)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    last = [x for x in r.stderr.strip().splitlines() if x.startswith("error: ")]
    assert last and "learner: a rank died during a step" in last[-1] and "resume=<run dir>" in last[-1], last
    assert "Traceback" not in r.stderr
    assert os.readlink(run_dir / "checkpoints" / "opd" / "latest") == "step_2"
    r = helpers.run_main(*_overrides(tiny_target, run_dir), f"resume={run_dir}", timeout=2400)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
