"""Killed actors: `kill -9` of a rollout worker and, later, of the replay actor at random moments of a short run.
Ray restarts each (`cluster.max_restarts`), the loop gives it the current weights and redoes its lost work, the
run completes, the restarts are counted in the metrics, and every anchor record in `anchors/` is counted once
(the records of the lost round are generated again, not lost and not taken twice). Slow: `make test-slow`."""

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


def _pids(title: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"ray::{title}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _opd_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(r["stage"] == "opd" for r in read_metrics(path)) if path.is_file() else 0


def _killer(run_dir: Path, killed: dict[str, int], rng: random.Random) -> None:
    """After step 1 (and a random pause), kill a rollout worker in the middle of a round; after step 2, the replay
    actor in the middle of scoring (Ray titles a busy actor's process `ray::<Class>.<method>`)."""
    for after, title in ((1, "RolloutWorker.generate"), (2, "ReplayActor.score")):
        deadline = time.monotonic() + 1200
        while _opd_steps(run_dir) < after and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(rng.uniform(0.0, 2.0))
        while not (pids := _pids(title)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            killed[title.split(".")[0]] = killed.get(title.split(".")[0], 0) + 1


def test_killed_rollout_worker_and_replay_actor_are_restarted_and_nothing_is_lost(
    tiny_target: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    killed: dict[str, int] = {}
    t = threading.Thread(target=_killer, args=(run_dir, killed, random.Random(0)), daemon=True)
    t.start()
    r = helpers.run_main(
        "stages=[opd]",
        f"target.path={tiny_target}",
        "draft.aux_layer_ids=[0,1,2]",
        "rollout.prompts_per_round=4",
        "rollout.max_new_tokens=24",
        "data.train.max_prompts=16",
        f"opd.steps={STEPS}",
        "opd.checkpoint_every=2",
        "wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
        timeout=2400,
    )
    t.join(timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert killed == {"RolloutWorker": 1, "ReplayActor": 1}, killed
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["rollout_restarts"] >= 1 and rows[-1]["replay_restarts"] >= 1, rows[-1]
    for m in rows:  # every record a step used is in anchors/ once, and only those
        recs = read_parquet(run_dir / "anchors" / f"step_{m['step'] - 1:05d}.parquet")
        assert len(recs) == m["records"], (m["step"], len(recs), m["records"])
    assert len(list((run_dir / "anchors").glob("*.parquet"))) == STEPS
