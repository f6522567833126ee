"""Exact resume: a run killed (SIGKILL, the whole process group) at a random moment after its step-2 checkpoint
and resumed with `resume=<run dir>` logs the same losses, τ and versions as the same run left alone, with no
duplicate metrics rows. Two rollout workers (the default plan): a step trains on the next rounds in feed
order (`opd.rounds_per_step`), whichever worker finishes first. Greedy rollouts, fp32 on CPU. The checkpoint
holds the pipeline (the feed's position and the rounds in flight), so the resumed run sees the same rounds.
A Ctrl-C after a checkpoint stops the run within seconds, with one line naming that checkpoint and the resume
command; the resumed run finishes. Slow: `make test-slow`."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draft_opd_ray.metrics import read_metrics
from tests import helpers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.ray, pytest.mark.deepspeed]

STEPS = 4
LOSS_RTOL = 1e-5  # fp32 on CPU, the same ops in the same order: equal up to summation noise


def _overrides(target: Path, run_dir: Path) -> list[str]:
    return helpers.short_opd_run(target, run_dir, STEPS, "cluster.rollout_engines=2")


def _opd_rows(run_dir: Path) -> list[dict]:
    return [m for m in read_metrics(run_dir / "metrics.jsonl") if m["stage"] == "opd"]


def _start_until_step_2(target: Path, run_dir: Path, stderr: int) -> subprocess.Popen[str]:
    """Start the run in its own process group (which a terminal's Ctrl-C signals whole), with Ctrl-C's default
    action even under a parent that ignores SIGINT; return once `latest` names step_2."""
    p = subprocess.Popen(
        [sys.executable, "-m", "draft_opd_ray.main", *_overrides(target, run_dir)],
        cwd=helpers.REPO,
        env={**os.environ, "PYTHONPATH": str(helpers.REPO)},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    latest = run_dir / "checkpoints" / "opd" / "latest"
    deadline = time.monotonic() + 1200
    while not (latest.is_symlink() and os.readlink(latest) == "step_2"):
        assert p.poll() is None, "the run ended before its step-2 checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return p


def _default_sigint() -> None:
    """In the child: Ctrl-C's default action, even under a parent that ignores SIGINT (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_after_checkpoint(target: Path, run_dir: Path, seed: int) -> float:
    """Start the run, SIGKILL its process group at a random moment after `latest` names step_2 (before step_4);
    returns the seconds after the checkpoint at which it was killed."""
    p = _start_until_step_2(target, run_dir, stderr=subprocess.DEVNULL)
    latest = run_dir / "checkpoints" / "opd" / "latest"
    wait = random.Random(seed).uniform(0.0, 3.0)
    time.sleep(wait)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    assert os.readlink(latest) == "step_2", "killed too late: step_4 was already saved"
    return wait


def test_a_killed_run_resumes_exactly(tiny_target: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    r = helpers.run_main(*_overrides(tiny_target, whole), timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    expected = _opd_rows(whole)
    assert [m["step"] for m in expected] == list(range(1, STEPS + 1))

    cut = tmp_path / "cut"
    _kill_after_checkpoint(tiny_target, cut, seed=0)
    r = helpers.run_main(*_overrides(tiny_target, cut), f"resume={cut}", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    got = _opd_rows(cut)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # no duplicate rows, none missing
    for a, b in zip(expected, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL), (a["step"], a["loss"], b["loss"])
        for k in ("tau", "policy_version", "dropped_stale", "anchors"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
    times = [m["time"] for m in got]
    assert times == sorted(times)  # the clock continued, it did not restart at 0
    assert os.readlink(cut / "checkpoints" / "opd" / "latest") == f"step_{STEPS}"
    assert not list((cut / "checkpoints" / "opd").glob(".tmp-*"))


def test_ctrl_c_stops_the_run_and_says_how_to_resume(tiny_target: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    p = _start_until_step_2(tiny_target, run_dir, stderr=subprocess.PIPE)
    sent = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    took = time.monotonic() - sent
    print(f"Ctrl-C to exit: {took:.1f} s")
    assert p.returncode == 130, err[-3000:]
    assert took < 60, took  # Ray's shutdown included
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted: the last complete checkpoint (checkpoints/opd/step_"), err[-3000:]
    assert last.endswith(f"is kept: resume={run_dir} continues from it"), last
    assert "Traceback" not in err, err[-3000:]
    r = helpers.run_main(*_overrides(tiny_target, run_dir), f"resume={run_dir}", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in _opd_rows(run_dir)] == list(range(1, STEPS + 1))
