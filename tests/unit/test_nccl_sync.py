"""Which weight transport a placement allows (`sync/nccl.py`): NCCL refuses two ranks on one GPU, so where
the plan puts the learner's rank 0 (the sender) on a GPU an engine also uses (`+cluster=gpu_shared`) `auto` takes
a file transport and an explicit `nccl` is refused at validation, before anything loads. No Ray, no vLLM.
The sync's bookkeeping with Ray actors: tests/integration/test_nccl_sync.py."""

from __future__ import annotations

import re

import pytest

from draft_opd_ray.config.store import compose
from draft_opd_ray.errors import ConfigError
from draft_opd_ray.loop.opd import make_weight_sync
from draft_opd_ray.placement import plan_for
from draft_opd_ray.preflight import validate
from draft_opd_ray.sync.nccl import plan_weight_sync, sender_shared_gpu
from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync
from tests import helpers

SHARED = "learner rank 0 and rollout engine 0 on GPU 0 of node 0"


@pytest.mark.parametrize(
    ("overrides", "shared", "kind"),
    [
        (["+cluster=gpu_shared"], SHARED, "shm_file"),
        (["+cluster=gpu_shared", "cluster.num_nodes=2"], SHARED, "object_store"),  # first fit: all on node 0
        (["+cluster=gpu_shared", "cluster.gpus_per_node=2", "cluster.gpus_per_learner=1"], "", "nccl"),
        (["+cluster=8xA100"], "", "nccl"),
        (["+cluster=2x8xH100"], "", "nccl"),
        ([], "", "shm_file"),  # this machine: no GPU
    ],
)
def test_auto_takes_nccl_only_where_the_sender_has_a_gpu_of_its_own(
    overrides: list[str], shared: str, kind: str
) -> None:
    plan = plan_for(compose(overrides))
    assert sender_shared_gpu(plan) == shared
    assert plan_weight_sync("auto", plan) == kind
    assert plan_weight_sync("shm_file", plan) == "shm_file"


def test_the_loop_builds_a_file_transport_on_a_shared_gpu() -> None:
    """`make_weight_sync` from the config alone (the loop passes its plan): no sender and no engines are needed,
    because it does not pick NCCL there."""
    for overrides, cls in [
        (["+cluster=gpu_shared"], SharedFileWeightSync),
        (["+cluster=gpu_shared", "cluster.num_nodes=2"], ObjectStoreWeightSync),
    ]:
        sync = make_weight_sync(compose(overrides), [])
        try:
            assert type(sync) is cls
        finally:
            sync.close()


def test_explicit_nccl_on_a_shared_gpu_is_refused_at_validation() -> None:
    message = f"rollout.weight_sync: nccl cannot broadcast between ranks on one GPU, and the placement puts {SHARED}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(compose(["+cluster=gpu_shared", "rollout.weight_sync=nccl"]))
    with pytest.raises(ConfigError, match="rollout.weight_sync: nccl needs GPUs"):
        validate(compose(["rollout.weight_sync=nccl"]))
    validate(compose(["+cluster=8xA100", "rollout.weight_sync=nccl"]))  # a GPU of its own: fine
    validate(compose(["+cluster=gpu_shared", "rollout.weight_sync=nccl", "stages=[sft]"]))  # no weight sync


def test_explicit_nccl_on_a_shared_gpu_is_one_line_exit_2() -> None:
    r = helpers.run_main(
        "+cluster=gpu_shared", "rollout.weight_sync=nccl", "dry_run=true", HYDRA_FULL_ERROR="0"
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: rollout.weight_sync: nccl cannot broadcast between ranks on one GPU")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
