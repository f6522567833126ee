"""Verified refits on the real vLLM CPU engine for every draft kind: after a publication through either CPU
transport each rollout worker reads its draft back from the engine (`DraftWeightExtension.draft_fingerprints`)
and the sync compares it with what the learner sent (`sync/refit.py`). A correct refit passes and the engine then
serves other weights; a tensor altered after the checksum, or a receiver on another version, stops with a
one-line `RefitError` naming the receiver and the version. The replay actor's draft copy (redraft) is checked
the same way.

One Ray worker (one engine) per draft kind on the tiny target, reused by its cases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from draft_opd_ray.errors import RefitError
from tests.helpers import perturbed, replay_actor

pytestmark = [pytest.mark.vllm, pytest.mark.ray]

# EAGLE-3 (the default kind) in the default suite; the other two kinds' engines cost ~2 min each here: slow
KINDS = [
    "eagle3",
    pytest.param("standalone", marks=pytest.mark.slow),
    pytest.param("dflash", marks=pytest.mark.slow),
]
NUM_SPECULATIVE_TOKENS = 4


def _draft(kind: str, target: Path, out: Path) -> Path:
    from draft_opd_ray.drafts.dflash.model import init_dflash, save_dflash
    from draft_opd_ray.drafts.eagle3.model import init_eagle3, save_eagle3
    from draft_opd_ray.drafts.standalone.model import build_standalone_from_target

    if kind == "eagle3":
        return save_eagle3(init_eagle3(target, aux_layer_ids=[0, 1, 2]), out, target)
    if kind == "standalone":
        return build_standalone_from_target(target, out, num_layers=1)
    return save_dflash(init_dflash(target, num_layers=1, block_size=NUM_SPECULATIVE_TOKENS + 1), out, target)


@pytest.fixture(scope="module")
def ray_local() -> Any:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module", params=KINDS)
def case(request: pytest.FixtureRequest, ray_local: Any, tiny_target: Path, tmp_path_factory: Any) -> Any:
    """(kind, worker actor, draft folder, the learner's state of the draft) for one kind."""
    from draft_opd_ray.config.schema import DraftConfig, RolloutConfig, TargetConfig
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.rollout.engine import EngineRun
    from draft_opd_ray.rollout.worker import RolloutWorker

    kind = request.param
    draft = _draft(kind, tiny_target, tmp_path_factory.mktemp(kind) / "draft")
    state = draft_kind(kind).student(str(draft), str(tiny_target)).rollout_state()
    worker = ray_local.remote(num_cpus=1)(RolloutWorker).remote(
        0,
        EngineRun(str(tiny_target), kind, str(draft)),
        DraftConfig(kind=kind, num_speculative_tokens=NUM_SPECULATIVE_TOKENS),
        TargetConfig(max_model_len=256),
        RolloutConfig(),
    )
    yield kind, worker, draft, state
    ray_local.get(worker.shutdown.remote())
    ray_local.kill(worker)


def _make(transport: str, receivers: list[Any]) -> Any:
    from draft_opd_ray.sync.weight_sync import ObjectStoreWeightSync, SharedFileWeightSync

    return SharedFileWeightSync(receivers) if transport == "shm_file" else ObjectStoreWeightSync(receivers)


@pytest.mark.parametrize("transport", ["shm_file", pytest.param("object_store", marks=pytest.mark.slow)])
def test_correct_refit_passes_and_is_served(case: Any, transport: str) -> None:
    import ray

    kind, worker, _, state = case
    before = ray.get(worker.refit_ack.remote())
    sync = _make(transport, [worker])
    v = 1 if transport == "shm_file" else 3
    sync.publish(v, perturbed(state, 0.3, seed=v))
    assert sync.wait() == [v]  # checked: the engine serves exactly what was sent
    after = ray.get(worker.refit_ack.remote())
    assert after.version == v
    changed = [n for n in after.tensors if after.tensors[n] != before.tensors[n]]
    assert changed, f"{kind}: the engine serves the same tensors after a refit"
    sync.publish(v + 1, state)  # back to the original weights: the read-back returns to its first value
    sync.close()
    back = ray.get(worker.refit_ack.remote())
    assert back.tensors == before.tensors


@pytest.mark.parametrize("transport", ["shm_file", pytest.param("object_store", marks=pytest.mark.slow)])
def test_tensor_altered_after_the_checksum_is_refused(case: Any, transport: str) -> None:
    kind, worker, _, state = case
    sync = _make(transport, [worker])
    sync.version = 10
    name = next(n for n, t in state.items() if t.is_floating_point() and t.dim() == 2 and "lm_head" not in n)
    take = sync.checks.sent

    def sent_then_corrupted(weights: dict[str, torch.Tensor]) -> Any:
        fps = take(weights)
        weights[name] = weights[name].clone()
        weights[name][0, 0] += 1.0  # after the checksum, before the transfer
        return fps

    sync.checks.sent = sent_then_corrupted
    sync.publish(11, dict(state))
    with pytest.raises(RefitError, match=r"version 11 on rollout worker 0 \(float32\): served values differ"):
        sync.wait()
    sync.checks.sent = take
    sync.publish(12, dict(state))  # a clean refit afterwards passes
    assert sync.wait() == [12]


def test_wrong_version_is_refused(case: Any) -> None:
    import ray

    from draft_opd_ray.sync.refit import check_ack

    _, worker, _, state = case
    sync = _make("shm_file", [worker])
    sync.version = 20
    sync.publish(21, dict(state))
    sync.wait()
    sent = sync.checks.sent(state)
    ack = ray.get(worker.refit_ack.remote())
    check_ack(ack, 21, sent)
    with pytest.raises(
        RefitError, match="weight refit of version 22 on rollout worker 0: it serves version 21"
    ):
        check_ack(ack, 22, sent)
    sync.close()


def test_replay_draft_copy_is_checked(case: Any, tiny_target: Path) -> None:
    """redraft: the replay actor is a receiver too; its copy's fingerprints follow the same check."""
    from draft_opd_ray.drafts.registry import draft_kind
    from draft_opd_ray.sync.refit import check_ack, fingerprints

    kind, _, draft, state = case
    feats, ids = draft_kind(kind).replay_needs(str(draft), str(tiny_target))
    replay = replay_actor(
        tiny_target, feats, ids, NUM_SPECULATIVE_TOKENS, kind=kind, mode="redraft", draft_dir=str(draft)
    )
    noisy = perturbed(state, 0.3, seed=5)
    replay.load_draft_weights(noisy, 5)
    ack = replay.refit_ack()
    check_ack(ack, 5, {ack.dtype: fingerprints(noisy.items(), getattr(torch, ack.dtype))})
    with pytest.raises(RefitError, match="version 5 on replay actor .*differ"):
        check_ack(ack, 5, {ack.dtype: fingerprints(state.items())})
