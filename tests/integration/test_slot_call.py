"""The driver holds no model: with a reservation, the SFT answers and eval's engines run as a Ray task in rollout
bundle 0 (`draft_opd_ray.slot_call`), on real Ray with the run's real placement group."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from draft_opd_ray.config.schema import Config
from draft_opd_ray.errors import DataError
from draft_opd_ray.placement import plan_for
from draft_opd_ray.slot_call import call_in_slot

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def reservation() -> Iterator[Any]:
    import ray

    from draft_opd_ray.cluster import reserve

    ray.init(num_cpus=4, include_dashboard=False, namespace="test_slot_call")
    res = reserve(plan_for(Config()), timeout_s=60)
    yield res
    res.release()
    ray.shutdown()


def where(tag: str) -> dict[str, Any]:
    """Which process and which placement-group bundle this runs in."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "tag": tag,
        "pid": os.getpid(),
        "pg": ctx.get_placement_group_id(),
        "gpus": ctx.get_accelerator_ids(),
    }


def fails(message: str) -> None:
    raise DataError(message)


def test_the_work_runs_in_rollout_bundle_zero_and_returns_its_result(reservation: Any) -> None:
    got = call_in_slot(reservation, "test: where", where, "x")
    assert got["tag"] == "x" and got["pid"] != os.getpid()
    assert got["pg"] == reservation.pg.id.hex()


def test_the_tasks_error_comes_back_as_itself(reservation: Any) -> None:
    """main turns a DataError/ConfigError into one line and exit 2: a task's must still be one."""
    with pytest.raises(DataError, match="no prompts left"):
        call_in_slot(reservation, "test: fails", fails, "no prompts left")


def test_without_a_reservation_the_work_runs_here() -> None:
    assert call_in_slot(None, "test: here", os.getpid) == os.getpid()
